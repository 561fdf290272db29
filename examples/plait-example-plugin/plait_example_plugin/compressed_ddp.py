"""``ddp_fp16``: DistributedDataParallel whose gradient all-reduce travels in float16.

Half the bytes on the wire for the same update: DDP's ``fp16_compress_hook``
casts each gradient bucket to float16, all-reduces it and casts back. A
parallelism plugin implements ``wrap``, ``sync_context`` and ``clip_grad_norm``
(:class:`core.contract.protocols.Parallelism`); ``shards_parameters`` and
``wraps_before_compile`` are optional facts (``python -m core.plugins --contract``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from core.api import option


@dataclass
class DDPFP16Options:
    bucket_cap_mb: int = option(25, "gradient all-reduce bucket size in MiB", gt=0)


class DDPFP16:
    shards_parameters = False  # every rank holds the whole model (plan's memory estimate)
    wraps_before_compile = True  # wrap, then compile the blocks

    def __init__(self, options: DDPFP16Options) -> None:
        self.options = options

    def wrap(self, model: nn.Module, spec, dist, precision) -> nn.Module:
        if dist.world_size == 1:
            return model
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        ddp = DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None, bucket_cap_mb=self.options.bucket_cap_mb)
        ddp.register_comm_hook(state=None, hook=fp16_compress_hook)
        return ddp

    def sync_context(self, model: nn.Module, sync: bool):
        if sync or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()  # accumulate locally; the last micro-step all-reduces

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
