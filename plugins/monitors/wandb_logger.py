"""``wandb``: metrics to Weights & Biases, offline by default (extra ``wandb``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.api import PluginError, hookimpl, option
from plugins.monitors.mlflow_logger import numeric


@dataclass
class WandbOptions:
    project: str = option("plait", "W&B project")
    mode: Literal["offline", "online", "disabled"] = option("offline", "offline writes <output_dir>/wandb for a later `wandb sync`")
    run_name: str = option("", "run name; empty: the output folder's name")


class WandbLogger:
    def __init__(self, options: WandbOptions) -> None:
        self.options = options
        self.run = None

    @hookimpl
    def plait_train_start(self, run):
        if not run.dist.is_main:
            return
        try:
            import wandb
        except ImportError as e:
            raise PluginError(f"monitor 'wandb' needs wandb (pip install 'plait[wandb]'): {e}") from None
        o = self.options
        self.run = wandb.init(
            project=o.project, mode=o.mode, dir=str(run.output_dir), config=run.config, name=o.run_name or run.output_dir.name, resume="allow"
        )

    @hookimpl
    def plait_step_end(self, run, step, metrics):
        if metrics and self.run is not None:
            self.run.log(numeric(metrics), step=step)

    @hookimpl
    def plait_validation_end(self, run, step, metrics):
        if self.run is not None:
            self.run.log(numeric(metrics), step=step)

    @hookimpl
    def plait_train_end(self, run, reason):
        if self.run is not None:
            self.run.summary["end_reason"] = reason
            self.run.finish()
            self.run = None
