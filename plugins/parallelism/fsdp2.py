"""``fsdp2``: parameters, gradients and optimizer state sharded over ranks with ``fully_shard``.

Each transformer block is one FSDP unit, and the root module (embeddings,
final norm, head) is another. With bf16 precision the unit computes in bf16
and reduces gradients in fp32 (MixedPrecisionPolicy); the sharded fp32
parameters stay the optimizer's master weights. ``replicate > 1`` gives HSDP:
a 2-D mesh (replicate x shard) that shards within groups of
``world_size / replicate`` ranks and all-reduces across groups.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from core.errors import ConfigError
from core.options import option
from plugins.parallelism.common import clip_grad_norm


@dataclass
class FSDP2Options:
    reshard_after_forward: bool = option(True, "free gathered parameters after each block's forward (less memory, one more all-gather)")
    replicate: int = option(1, "HSDP: number of replica groups; world size / replicate ranks shard each replica")
    cpu_offload: bool = option(False, "keep sharded parameters, gradients and optimizer state in CPU memory")

    def check(self) -> None:
        if self.replicate < 1:
            raise ValueError("replicate must be >= 1")


class FSDP2:
    shards_parameters = True

    def __init__(self, options: FSDP2Options) -> None:
        self.options = options

    def check_world(self, world_size: int) -> None:
        if world_size % self.options.replicate:
            raise ConfigError(
                f"[parallelism] fsdp2: replicate = {self.options.replicate} does not divide the world size {world_size}"
            )

    def wrap(self, model: nn.Module, spec, dist, precision) -> nn.Module:
        if dist.world_size == 1:
            return model  # nothing to shard over: behave like a single process
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        o = self.options
        device_type = dist.device.type
        if o.replicate > 1:
            mesh = init_device_mesh(device_type, (o.replicate, dist.world_size // o.replicate), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device_type, (dist.world_size,), mesh_dim_names=("shard",))
        kwargs = {"mesh": mesh}
        if precision.param_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=torch.float32)
        if o.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        blocks = spec.blocks(model)
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again at once by the backward pass.
            fully_shard(block, reshard_after_forward=o.reshard_after_forward and i < len(blocks) - 1, **kwargs)
        fully_shard(model, reshard_after_forward=o.reshard_after_forward, **kwargs)
        return model

    def sync_context(self, model: nn.Module, sync: bool):
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(model, max_norm)
