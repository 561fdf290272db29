"""A checkpoint folder as every rank of this job sees it (:class:`CheckpointDir`): its options, its
process group, and the integer agreements its collectives make. It exists before any training
state: resume checks candidates with it, and the :class:`core.checkpoint.checkpointer.Checkpointer`
saves into it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.checkpoint.folders import CheckpointOptions, committed, lineage_of
from core.contract.protocols import DistInfo
from core.runtime.distributed import agree


class CheckpointDir:
    """A checkpoint folder as every rank of this job sees it: its options, and the process
    group its collectives use. Exists before any training state (resume checks candidates with it)."""

    def __init__(self, opts: CheckpointOptions, root: Path, dist: DistInfo, control: Any) -> None:
        self.opts, self.root, self.dist, self.control = opts, root, dist, control
        self.group = None
        if dist.world_size > 1:
            from core.runtime.distributed import gloo_group

            # DCP collectives get a gloo group of their own: async saves run them from a background
            # thread, beside the training collectives. It waits for a hung rank as long as they do.
            self.group = gloo_group()
            from core.checkpoint.shared_folder import check_shared

            # one folder that every node sees, before any checkpoint is read or written (exit 2 if not)
            check_shared(self, "[checkpoint].dir" if opts.dir else "the checkpoint folder <output_dir>/checkpoints")

    def agree(self, value: int, op: str = "min") -> int:
        """The same integer on every rank: :func:`core.runtime.distributed.agree` over the checkpoint group."""
        return int(agree(value, op, self.group))

    def own(self, lineage: str) -> list[Path]:
        """This run's committed checkpoints, oldest first."""
        return [p for p in committed(self.root) if lineage_of(p) == lineage]
