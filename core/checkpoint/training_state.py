"""What a checkpoint holds, by part: :class:`TrainingState`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TrainingState:
    """Everything a checkpoint holds, by part (``checkpoint.exclude_from_loading`` names them):
    ``model`` and ``optimizer`` (DCP shards), ``lr_schedule`` (``scheduler``), ``data``
    (``loader``'s position), ``train`` (``run``: step, tokens, ``run.state``) and ``rng``."""

    model: torch.nn.Module  # the unwrapped module: its state dict names are the checkpoint's
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: Any
    run: Any  # core.contract.run.Run

    @property
    def lineage(self) -> str:
        """This run's id: made at a fresh start, carried through every resume (``run.state``)."""
        return self.run.state["lineage"]
