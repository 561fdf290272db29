"""The Lion optimizer as a plait optimizer plugin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.api import OptimizerOptions, option


@dataclass
class LionOptions(OptimizerOptions):
    betas: tuple[float, float] = option((0.9, 0.99), "(beta1, beta2): update and momentum interpolation")


class LionOptimizer(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return None


class Lion:
    state_bytes_per_param = 4  # one fp32 momentum

    def __init__(self, options: LionOptions) -> None:
        self.options = options

    def build(self, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        o = self.options
        return LionOptimizer(param_groups, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
