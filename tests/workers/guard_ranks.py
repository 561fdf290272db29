"""Run under torchrun (gloo, 2 ranks): a small DDP model trained by fused AdamW through
core.loop.nonfinite.NonFiniteGuard, where only rank 1's loss is NaN at steps 2 and 3 (its gradients
stay finite, so only the guard's all-reduce can make rank 0 skip too). A two-step flag buffer
makes the guard fold its counters mid-run. Rank 0 writes what it saw as JSON to argv[1]."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel

from core.loop.nonfinite import NonFiniteGuard
from core.runtime import distributed

STEPS, NAN_STEPS = 6, (2, 3)


def main() -> None:
    info = distributed.init("cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = NonFiniteGuard(opt, info, history=2)
    changed, flags = [], []
    for step in range(STEPS):
        x = torch.full((3, 4), float(info.rank + step + 1))
        loss = model(x).pow(2).mean()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        seen = loss * float("nan") if (info.rank == 1 and step in NAN_STEPS) else loss
        before = [p.detach().clone() for p in model.parameters()]
        bad = guard.flag(seen, grad_norm)
        guard.step(opt, bad)
        opt.zero_grad(set_to_none=True)
        flags.append(float(bad))
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    both = [torch.zeros_like(flat) for _ in range(2)]
    tdist.all_gather(both, flat)
    counters = guard.read()
    if info.is_main:
        out = {"flags": flags, "changed": changed, "counters": counters, "ranks_equal": torch.equal(both[0], both[1])}
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    del model  # DDP's reducer goes before the process group it uses
    tdist.barrier()
    distributed.shutdown()


if __name__ == "__main__":
    main()
    os._exit(0)  # as core.train leaves: interpreter finalization can abort a finished gloo rank (core/cli/train.py)
