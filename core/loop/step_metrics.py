"""The core's metrics of a log step: loss, gradient norm, LR, tokens/s, timing and the ETA, and
what the precision, the model and the data report. Computed on log steps only (they sync the
host). Monitors add more through ``plait_metrics`` (MFU, memory, update ratios)."""

from __future__ import annotations

import numbers
import time
from typing import Any

import torch

from core.contract.errors import PluginError
from core.contract.protocols import DistInfo
from core.runtime import distributed


def is_metric(value: Any) -> bool:
    """A number, or a list of numbers (per expert, per source...)."""
    return isinstance(value, numbers.Real) or (isinstance(value, (list, tuple)) and all(isinstance(v, numbers.Real) for v in value))


class StepMetrics:
    """Counts the steps and time of a log window, and turns them into the logged metrics."""

    def __init__(self, dist: DistInfo) -> None:
        self.dist = dist
        self.data_wait_s = 0.0  # time spent fetching batches in this window
        self.window_t0, self.window_steps = time.perf_counter(), 0

    def step_done(self) -> None:
        self.window_steps += 1

    def collect(self, run: Any, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, seq_len: int, extra: dict[str, Any]) -> dict[str, Any]:
        """The metrics of step ``run.step`` over the window since the last log step; ``extra``:
        the precision's, the model's and the data's own metrics, merged last."""
        now = time.perf_counter()
        steps, window_s = max(self.window_steps, 1), max(now - self.window_t0, 1e-9)
        per_step = window_s / steps
        tokens_per_s = run.tokens_per_step * self.window_steps / window_s
        metrics: dict[str, Any] = {
            "step": run.step,
            "loss": distributed.mean_across_ranks(loss, self.dist).item(),
            "grad_norm": float(grad_norm.item()),
            "lr": lr,
            "tokens_seen": run.tokens_seen,
            "tokens_per_s": tokens_per_s,
            "step_time_s": per_step,
            "elapsed_s": run.state["wall_time_s"],
            "eta_s": per_step * (run.total_steps - run.step),
            "tokens_per_s_per_device": tokens_per_s / self.dist.world_size,
            "seq_len": seq_len,
            "data_wait_s": self.data_wait_s / steps,
        }
        for what, more in extra.items():
            if not isinstance(more, dict) or not all(isinstance(k, str) and is_metric(v) for k, v in more.items()):
                raise PluginError(f"{what} returned {more!r:.200}; expected a dict of metric names to numbers (or lists of numbers)")
            metrics.update(more)
        self.data_wait_s = 0.0
        self.window_t0, self.window_steps = time.perf_counter(), 0
        return metrics
