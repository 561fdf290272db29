"""The metrics of a log step: loss, throughput, MFU, memory, update ratios, and what the
precision, the model and the data report. Computed on log steps only (they sync the host)."""

from __future__ import annotations

import time
from typing import Any

import torch

from core import distributed
from core import metrics as core_metrics
from core.protocols import DistInfo


class StepMetrics:
    """Counts the steps and time of a log window, and turns them into the logged metrics."""

    def __init__(self, dist: DistInfo, flops_per_token: float, optimizer: torch.optim.Optimizer) -> None:
        self.dist = dist
        self.flops_per_token = flops_per_token
        self.update_ratio = core_metrics.UpdateRatio(optimizer)
        self.data_wait_s = 0.0  # time spent fetching batches in this window
        self.window_t0, self.window_steps = time.perf_counter(), 0

    def step_done(self) -> None:
        self.window_steps += 1

    def collect(self, run: Any, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, seq_len: int, extra: list[dict[str, Any]]) -> dict[str, Any]:
        """The metrics of step ``run.step`` over the window since the last log step; ``extra``:
        the precision's, the model's and the data's own metrics, merged last."""
        now = time.perf_counter()
        steps, window_s = max(self.window_steps, 1), max(now - self.window_t0, 1e-9)
        per_step = window_s / steps
        tokens_per_s = run.tokens_per_step * self.window_steps / window_s
        per_device = tokens_per_s / self.dist.world_size
        mfu = core_metrics.mfu(per_device, self.flops_per_token, self.dist.device)
        peak = core_metrics.peak_flops(self.dist.device)
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
            "tokens_per_s_per_device": per_device,
            "seq_len": seq_len,
            "mfu": mfu if mfu is not None else "n/a",
            "peak_tflops": peak / 1e12 if peak is not None else "n/a",
            "data_wait_s": self.data_wait_s / steps,
        }
        metrics.update(core_metrics.memory(self.dist.device))
        metrics.update(self.update_ratio.after())
        for more in extra:
            metrics.update(more)
        self.data_wait_s = 0.0
        self.window_t0, self.window_steps = time.perf_counter(), 0
        return metrics
