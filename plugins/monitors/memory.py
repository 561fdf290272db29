"""``memory``: what a log step holds in memory: the training state's bytes per rank on every device,
and the device memory on CUDA, in GiB.

On every device, the largest rank's (``core.api.Reduced`` ``max``) local bytes of:
``mem_params_gib`` the optimizer's parameters, ``mem_grads_gib`` their gradients (counted just
before the optimizer steps: a step pre-hook on ``run.optimizer``, on log steps only) and
``mem_optimizer_gib`` the optimizer's state tensors. A sharded parameter (a DTensor: fsdp2, tensor
and expert parallel) counts its local shard; under pipeline parallelism a rank counts its own
stages. These are the tensors' sizes (numel x element size), not the allocator's: a step whose
update is skipped reports none of them.

On CUDA also ``mem_allocated_gib``, ``mem_reserved_gib`` and ``mem_peak_gib`` (the peak allocated
since the run started).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from core.api import NoOptions, Reduced, hookimpl

GIB = 2**30


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard), each tensor counted once."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    total = 0
    for t in seen.values():
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


class Memory:
    def __init__(self, options: NoOptions) -> None:
        self.grad_bytes: int | None = None
        self.handle: Any = None

    @hookimpl
    def plait_train_start(self, run: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.handle = run.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self.before(run, optimizer))

    def before(self, run: Any, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer is about to step: count the gradients if this step will be logged."""
        if run.is_log_step(run.step + 1):
            self.grad_bytes = local_bytes(p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None)

    @hookimpl
    def plait_metrics(self, run: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        grads, self.grad_bytes = self.grad_bytes, None
        if grads is not None:
            optimizer = run.optimizer
            params = local_bytes(p for g in optimizer.param_groups for p in g["params"])
            state = local_bytes(t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
            out = {name: Reduced("max", value / GIB) for name, value in (("mem_params_gib", params), ("mem_grads_gib", grads), ("mem_optimizer_gib", state))}
        device = run.dist.device
        if device.type == "cuda":
            out["mem_allocated_gib"] = torch.cuda.memory_allocated(device) / GIB
            out["mem_reserved_gib"] = torch.cuda.memory_reserved(device) / GIB
            out["mem_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        return out

    @hookimpl
    def plait_train_end(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
