"""Run under torchrun (gloo, 2 ranks): the update_ratio monitor on a model the fsdp2 plugin shards (and
HSDP: replicate 2 x shard 1), one real SGD step, its metrics reduced by the core's MonitorHub; beside
it the whole model's ratio computed from the gathered weights, and the monitor's own value on an
unsharded copy of the same model taking the same step in one process. Rank 0's shard of the first
matrix is 50x larger than rank 1's, so a shard's own ratio is far from the whole model's. Each rank
writes what it got as JSON to argv[1] (its rank appended)."""

from __future__ import annotations

from pathlib import Path

import torch
from rank_worker import build_model, run_rank, wrap
from torch import nn

from core.contract.options import NoOptions
from core.contract.protocols import DistInfo
from core.contract.run import Run
from core.loop.monitor_hub import MonitorHub
from plugins.monitors.update_ratio import UpdateRatio
from plugins.parallelism.fsdp2 import FSDP2, FSDP2Options


def groups(model: nn.Module) -> list[dict]:
    return [{"params": [model[0].weight, model[1].weight], "name": "matrix"}, {"params": [model[0].bias, model[1].bias], "name": "bias"}]


def one_step(model: nn.Module, dist: DistInfo) -> tuple[dict, dict, dict]:
    """(old full weights, the monitor's metrics after one SGD step, new full weights)."""
    full = lambda: {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}  # noqa: E731
    old = full()
    opt = torch.optim.SGD(groups(model), lr=0.5)
    run = Run(config={}, output_dir=Path("."), dist=dist, total_steps=10, tokens_per_step=1, optimizer=opt, log_every=1)
    hub = MonitorHub([("update_ratio", UpdateRatio(NoOptions()))])
    hub.emit("plait_train_start", run=run)
    torch.manual_seed(1)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    run.step = 1
    got = hub.metrics(run, 1, {})
    hub.emit("plait_train_end", run=run, reason="completed")
    return old, got, full()


def whole_ratio(old: dict, new: dict, names: list[str]) -> float:
    change = sum(((new[n].double() - old[n].double()) ** 2).sum() for n in names)
    norm = sum((old[n].double() ** 2).sum() for n in names)
    return float(change.sqrt() / norm.sqrt())


def results(info: DistInfo) -> dict:
    names = {"matrix": ["0.weight", "1.weight"], "bias": ["0.bias", "1.bias"]}
    _, single, _ = one_step(build_model(), DistInfo())  # one process, no process group used
    out: dict = {"single": single}
    for label, replicate in (("fsdp2", 1), ("hsdp", 2)):
        model = build_model()
        wrap(FSDP2(FSDP2Options(replicate=replicate)), model, info)
        assert all(hasattr(p, "full_tensor") for p in model.parameters()), "fsdp2 left a parameter unsharded"
        old, got, new = one_step(model, info)
        out[label] = {"got": got, "whole": {g: whole_ratio(old, new, ns) for g, ns in names.items()}}
    return out


if __name__ == "__main__":
    run_rank(results)
