"""Run under torchrun (gloo): two training steps of the debug recurrent MoE on rank-specific data, then the
log-step metrics through core.contract.metrics.model_metrics; rank 0 writes them as JSON to argv[1]."""

from __future__ import annotations

import json
import sys

import torch

from core.contract.metrics import model_metrics
from core.runtime import distributed
from model_specs.recurrent_moe.spec import RecurrentMoEOptions, RecurrentMoESpec

MICRO, STEPS = 3, 2


def batch(rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randint(0, 512, (2, 32), generator=g)


def build():
    spec = RecurrentMoESpec.from_options(RecurrentMoEOptions())
    torch.manual_seed(0)
    model = spec.build()
    spec.init_weights(model)
    return model


def main() -> None:
    info = distributed.init("cpu")
    model = build()
    for step in range(STEPS):
        model.log_step(step == STEPS - 1)  # as the trainer says before every step: the last one is logged
        for micro in range(MICRO):
            ids = batch(info.rank, step, micro)
            (model(ids, ids) / MICRO).backward()
        got = model_metrics(model, info) if step == STEPS - 1 else None
        model.zero_grad(set_to_none=True)
    if info.is_main:
        with open(sys.argv[1], "w") as f:
            json.dump(got, f)
    distributed.shutdown()


if __name__ == "__main__":
    main()
