"""``mfu``: model FLOPs utilization of a log step, against the device's dense bf16 peak.

MFU = tokens/s per device x the model's FLOPs per token at the step's
sequence length (``flops_per_token``, docs/metrics.md) / the peak of
:data:`PEAK_BF16_TFLOPS` (no sparsity). CPUs and unknown devices report
``"n/a"`` rather than a guess. Adds ``mfu`` and ``peak_tflops``.
"""

from __future__ import annotations

from typing import Any

import torch

from core.api import NoOptions, hookimpl

# Dense bf16 tensor-core peak, TFLOP/s, from the vendors' data sheets.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("RTX PRO 6000 Blackwell", 503.8),
    ("RTX 6000 Ada", 364.0),
]


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None (a CPU, an unlisted GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


class MFU:
    def __init__(self, options: NoOptions) -> None:
        self.flops_per_token: dict[int, float] = {}  # by sequence length (stages change it)

    @hookimpl
    def plait_metrics(self, run: Any, metrics: dict[str, Any]) -> dict[str, Any]:
        peak = peak_flops(run.dist.device)
        if peak is None:
            return {"mfu": "n/a", "peak_tflops": "n/a"}
        seq_len = int(metrics["seq_len"])
        if seq_len not in self.flops_per_token:
            self.flops_per_token[seq_len] = float(run.spec.flops_per_token(seq_len))
        return {"mfu": metrics["tokens_per_s_per_device"] * self.flops_per_token[seq_len] / peak, "peak_tflops": peak / 1e12}
