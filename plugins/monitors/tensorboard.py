"""``tensorboard``: scalars in ``<output_dir>/<subdir>``, rank 0 only.

Training metrics go to ``train/<name>`` (``train/loss``, ``train/lr``,
``train/grad_norm``, ``train/tokens_per_s``...) plus ``train/perplexity`` =
``exp(loss)``; validation metrics to ``val/<name>`` with a leading ``val_``
dropped (``val_loss`` -> ``val/loss``). ``global_step`` is the step. A resumed
run purges events its output folder holds from steps after the checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.api import PluginError, hookimpl, option

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

SKIP = {"step"}


def scalar(value: Any) -> float | None:
    """A real number as float, or None for anything that is not one scalar."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


@dataclass
class TensorBoardOptions:
    subdir: str = option("tensorboard", "folder inside train.output_dir for the event files", inside=True)


class TensorBoard:
    def __init__(self, options: TensorBoardOptions) -> None:
        self.options = options
        self.writer: SummaryWriter | None = None
        try:  # lazy: only runs that enable this monitor pay for the import
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise PluginError(f"monitor 'tensorboard' needs the tensorboard package (pip install tensorboard): {e}") from None
        self._writer_cls = SummaryWriter

    @hookimpl
    def plait_train_start(self, run):
        if not run.dist.is_main:
            return
        self.writer = self._writer_cls(str(run.output_dir / self.options.subdir), purge_step=run.step + 1 if run.step else None)

    def _scalars(self, prefix: str, step: int, metrics: dict[str, Any]) -> None:
        writer = self.writer
        if writer is None:
            return
        for key, value in metrics.items():
            v = scalar(value)
            if key in SKIP or v is None:
                continue
            if prefix == "val" and key.startswith("val_"):
                key = key[len("val_") :]
            writer.add_scalar(f"{prefix}/{key}", v, global_step=step)

    @hookimpl
    def plait_step_end(self, run, step, metrics):
        if not metrics or self.writer is None:
            return
        self._scalars("train", step, metrics)
        loss = scalar(metrics.get("loss"))
        if loss is not None and math.isfinite(loss) and loss < 700:  # exp overflows past ~709
            self.writer.add_scalar("train/perplexity", math.exp(loss), global_step=step)

    @hookimpl
    def plait_validation_end(self, run, step, metrics):
        if self.writer is not None:
            self._scalars("val", step, metrics)

    @hookimpl
    def plait_checkpoint_saved(self, run, step, path):
        if self.writer is not None:
            self.writer.flush()

    @hookimpl
    def plait_train_end(self, run, reason):
        if self.writer is not None:
            self.writer.close()
            self.writer = None
