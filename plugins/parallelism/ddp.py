"""``ddp``: torch's DistributedDataParallel. On one process it wraps nothing."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from core.api import log, option
from plugins.parallelism.common import clip_grad_norm


@dataclass
class DDPOptions:
    bucket_cap_mb: int = option(25, "gradient all-reduce bucket size in MiB", gt=0)
    static_graph: bool = option(False, "tell DDP the graph is the same every step (enables some optimizations)")
    gradient_as_bucket_view: bool = option(True, "gradients are views into the all-reduce buckets (saves memory)")
    batched_grad_copy: bool = option(
        True, "copy gradients into the all-reduce buckets with one foreach copy per bucket, not one per parameter (torch >= 2.13; ignored before)"
    )
    broadcast_buffers: bool = option(
        False, "broadcast the model's buffers from rank 0 before every forward: only for buffers that training changes (RoPE tables do not)"
    )


class DDP:
    shards_parameters = False
    wraps_before_compile = True  # DDP, then compile (the order of the seed documents)

    def __init__(self, options: DDPOptions) -> None:
        self.options = options

    def wrap(self, model: nn.Module, spec, dist, precision) -> nn.Module:
        if dist.world_size == 1:
            return model
        o = self.options
        # torch 2.13 renamed the per-forward buffer sync (and warns at the old name; buffers are
        # synced once at the wrap either way) and added the batched gradient copy
        takes = inspect.signature(DistributedDataParallel.__init__).parameters
        extra: dict[str, Any] = {"forward_sync_buffers" if "forward_sync_buffers" in takes else "broadcast_buffers": o.broadcast_buffers}
        if "batched_grad_copy" in takes:
            extra["batched_grad_copy"] = o.batched_grad_copy
        elif o.batched_grad_copy:
            log.info(f"ddp: torch {torch.__version__} has no batched_grad_copy (torch 2.13 added it); gradients are copied into buckets one by one")
        return DistributedDataParallel(
            model,
            device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
            bucket_cap_mb=o.bucket_cap_mb,
            static_graph=o.static_graph,
            gradient_as_bucket_view=o.gradient_as_bucket_view,
            **extra,
        )

    def sync_context(self, model: nn.Module, sync: bool):
        if sync or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(model, max_norm)
