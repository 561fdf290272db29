"""Run under torchrun (gloo, 2 ranks): core.checkpoint.replicas.agreed_share with a real all-reduce, on the
same replicated state, then on states that differ (rank 1 holds one tensor more), then on DTensors: HSDP's
(replicate 2 x shard 1: both ranks hold the same shards) beside fsdp2's (sharded over both ranks). Rank 0
writes what each rank got as JSON to argv[1]."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as tdist

from core.checkpoint.replicas import agreed_share
from core.runtime import distributed


def agree(value: int, op: str) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    tdist.all_reduce(t, op=tdist.ReduceOp.MIN if op == "min" else tdist.ReduceOp.SUM)
    return int(t.item())


def main() -> None:
    info = distributed.init("cpu")
    state = {"model": {f"w{i}": torch.zeros(10 * (i + 1)) for i in range(6)}, "optimizer": {"param_groups": [{"lr": 0.1}]}}
    same = agreed_share(state, info.rank, 2, agree)
    if info.rank == 1:
        state["model"]["extra"] = torch.zeros(3)
    differ = agreed_share(state, info.rank, 2, agree)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    hsdp_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    fsdp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    dtensors = {
        "model": {f"h{i}": distribute_tensor(torch.zeros(8 * (i + 1), 4), hsdp_mesh, [Replicate(), Shard(0)]) for i in range(5)}
        | {"f": distribute_tensor(torch.zeros(8, 4), fsdp_mesh, [Shard(0)])},
        "optimizer": {"state": {"h0": {"step": torch.tensor(3.0)}}},
    }
    mixed = agreed_share(dtensors, info.rank, 2, agree)
    got = [None, None]
    mine = {"same": sorted(same["model"]) if same else None, "differ": differ}
    mine["dtensors"] = sorted(mixed["model"]) if mixed else None
    mine["steps"] = sorted(mixed["optimizer"]["state"]["h0"]) if mixed else None
    tdist.all_gather_object(got, mine)
    if info.is_main:
        with open(sys.argv[1], "w") as f:
            json.dump(got, f)
    tdist.barrier()
    distributed.shutdown()


if __name__ == "__main__":
    main()
    os._exit(0)  # as core.train leaves: interpreter finalization can abort a finished gloo rank (core/cli/train.py)
