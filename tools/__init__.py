"""plait tools: the commands around a run, built on the core.

The dry run (``python -m core.plan``), the plugin listing (``python -m core.plugins``),
the weight export (``python -m core.export``), the post-mortem report (``python -m core.report``)
and text generation (``python -m core.generate``) live here, with the tokenizer decoding that
export and generate share (:mod:`tools.text_codec`). The documented ``python -m core.<command>``
names are kept by one-line hand-offs in ``core/``; the modules here import the core, and the
core never imports ``tools``.
"""
