"""What the monitors that send a run to an experiment tracker (``mlflow``, ``wandb``) share: rank 0 alone
opens the tracker's run at the start (the tracker's package an optional extra, its absence one clear
error), sends every logged step's and every validation's numbers, and closes the run with its end reason."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from core.api import PluginError, hookimpl


def numeric(metrics) -> dict[str, float]:
    """The numbers of ``metrics`` but the step, ``/`` in their names written ``_``."""
    return {k.replace("/", "_"): float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


class TrackerLogger:
    """A monitor on rank 0 sending metrics to a tracker; a subclass names the ``package`` (also the
    monitor's name and the pip extra) and says how to open, log to and close the tracker's run."""

    package: str

    def __init__(self, options) -> None:
        self.options = options
        self.tracker: Any = None  # what open returned; None on other ranks and after the end

    def open(self, package: ModuleType, run) -> Any:
        raise NotImplementedError

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self, reason: str) -> None:
        raise NotImplementedError

    @hookimpl
    def plait_train_start(self, run):
        if not run.dist.is_main:
            return
        try:
            package = importlib.import_module(self.package)
        except ImportError as e:
            raise PluginError(f"monitor '{self.package}' needs {self.package} (pip install 'plait[{self.package}]'): {e}") from None
        self.tracker = self.open(package, run)

    @hookimpl
    def plait_step_end(self, run, step, metrics):
        if metrics and self.tracker is not None:
            self.log(numeric(metrics), step)

    @hookimpl
    def plait_validation_end(self, run, step, metrics):
        if self.tracker is not None:
            self.log(numeric(metrics), step)

    @hookimpl
    def plait_train_end(self, run, reason):
        if self.tracker is not None:
            self.close(reason)
            self.tracker = None
