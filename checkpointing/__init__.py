"""plait's checkpoints: the durable state of a run.

:class:`checkpointing.checkpointer.Checkpointer` saves the states it is built from (DCP shards,
``state.json``, RNGs) and commits a checkpoint only once every file is written and checksummed.
Around it: the folder layout and its verification (:mod:`.folders`, :mod:`.integrity`), DCP
storage that never runs code (:mod:`.safe_dcp`), which checkpoints stay (:mod:`.retention`),
choosing and loading the one to resume from (:mod:`.resume`, :mod:`.hyperparams`), one writer
per run folder (:mod:`.ownership`) and weights from other formats (:mod:`.weights`).
``docs/checkpoints.md`` is the user's guide.
"""
