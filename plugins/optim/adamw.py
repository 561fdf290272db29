"""``adamw``: torch.optim.AdamW over the core's parameter groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from core.api import OptimizerOptions, option


@dataclass
class AdamWOptions(OptimizerOptions):
    betas: tuple[float, float] = option((0.9, 0.95), "Adam's (beta1, beta2)", ge=0, lt=1)
    eps: float = option(1e-8, "Adam's epsilon; 0 would make the update of a zero gradient 0/0 = NaN", gt=0)
    impl: Literal["auto", "fused", "foreach", "for-loop"] = option(
        "auto", "kernel: auto picks fused where torch has one (CUDA, CPU, XPU, MPS; on CPU 3.5-5x foreach), else foreach"
    )


FUSED_DEVICES = frozenset({"cuda", "cpu", "xpu", "mps"})  # device types with torch's fused AdamW kernel


class AdamW:
    state_bytes_per_param = 8  # two fp32 moments

    def __init__(self, options: AdamWOptions) -> None:
        self.options = options

    def build(self, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        o = self.options
        devices = {p.device.type for g in param_groups for p in g["params"]}
        impl = o.impl if o.impl != "auto" else ("fused" if devices <= FUSED_DEVICES else "foreach")
        return torch.optim.AdamW(
            param_groups,
            lr=o.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=impl == "fused" or None,
            foreach=False if impl == "for-loop" else (impl == "foreach" or None),
        )
