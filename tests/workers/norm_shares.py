"""Run under torchrun (gloo, 2 ranks): ``core.api.squared_norm_share`` of every parameter and of its
gradient after one backward, on one model wrapped by the ddp plugin (replicas) and by the fsdp2 plugin
(DTensor shards; rank 0's rows of the first matrix are 50x larger than rank 1's, so a rank's share is
far from half), every rank training on the same batch. Beside them, the squared norms of an unwrapped
copy in this process (one rank's view: world size 1). Each rank writes its numbers as JSON to
argv[1] (its rank appended)."""

from __future__ import annotations

import torch
from rank_worker import build_model, run_rank, wrap
from torch import nn

from core.api import DistInfo, squared_norm_share
from plugins.parallelism.ddp import DDP, DDPOptions
from plugins.parallelism.fsdp2 import FSDP2, FSDP2Options


def shares(wrapped: nn.Module, model: nn.Module, world_size: int) -> dict[str, dict[str, float]]:
    """{name: {"param": share, "grad": share}} after one backward on the same batch as every rank's."""
    torch.manual_seed(1)
    wrapped(torch.randn(4, 8)).square().mean().backward()
    return {
        name: {"param": float(squared_norm_share(p, world_size)), "grad": float(squared_norm_share(p.grad, world_size))} for name, p in model.named_parameters()
    }


def results(info: DistInfo) -> dict:
    alone = build_model()
    out = {"single": shares(alone, alone, 1)}
    for label, parallelism in (("ddp", DDP(DDPOptions())), ("fsdp2", FSDP2(FSDP2Options()))):
        model = build_model()
        wrapped = wrap(parallelism, model, info)
        sharded = all(hasattr(p, "full_tensor") for p in model.parameters())
        assert sharded == (label == "fsdp2"), f"{label}: parameters sharded: {sharded}"
        out[label] = shares(wrapped, model, info.world_size)
    assert isinstance(info, DistInfo) and info.world_size == 2
    return out


if __name__ == "__main__":
    run_rank(results)
