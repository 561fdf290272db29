"""``wandb``: metrics to Weights & Biases, offline by default (extra ``wandb``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.api import option
from plugins.monitors.tracker import TrackerLogger


@dataclass
class WandbOptions:
    project: str = option("plait", "W&B project")
    mode: Literal["offline", "online", "disabled"] = option("offline", "offline writes <output_dir>/wandb for a later `wandb sync`")
    run_name: str = option("", "run name; empty: the output folder's name")


class WandbLogger(TrackerLogger):
    package = "wandb"

    def open(self, package, run):
        o = self.options
        return package.init(project=o.project, mode=o.mode, dir=str(run.output_dir), config=run.config, name=o.run_name or run.output_dir.name, resume="allow")

    def log(self, metrics, step):
        self.tracker.log(metrics, step=step)

    def close(self, reason):
        self.tracker.summary["end_reason"] = reason
        self.tracker.finish()
