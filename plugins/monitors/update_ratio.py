"""``update_ratio``: ||update|| / ||parameters|| per parameter group, on log steps.

Before the optimizer steps on a log step (a step pre-hook on
``run.optimizer``), the parameters are copied; at the log step the ratio of
the change to the old norm is reported per group, as
``update_ratio/<group>`` (the core's groups are ``matrix``, ``embedding``,
``norm`` and ``bias``). The copy costs one parameter-sized buffer on log
steps only (each rank its own shard). The ratio is the whole model's under
every parallelism: each rank sums its shard's squared change and squared
weights, and the core sums both over the ranks (``core.api.Reduced``) before
the ratio is taken; a tensor held by several ranks (DDP's replicas, HSDP's
replicated shards) counts once. A step whose update was skipped reports
nothing.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

from core.api import NoOptions, Reduced, hookimpl


def _is_dtensor(p: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``p`` is a DTensor. Asked of the loaded module, never importing it: there is no DTensor
    before ``torch.distributed.tensor`` is loaded, and loading it costs every plait command that
    reads the plugins (``core.plan`` too) about a CPU-second."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if _is_dtensor(p) else p


def _copies(p: torch.Tensor, world_size: int) -> int:
    """How many ranks hold this rank's part of ``p``: a plain tensor is on every rank (DDP's
    replicas, or one process); a DTensor's part is repeated over the mesh dims it is replicated on."""
    if not _is_dtensor(p):
        return world_size
    return math.prod(p.device_mesh.size(dim) for dim, placement in enumerate(p.placements) if placement.is_replicate())


def _ratio(sums: torch.Tensor) -> float:
    """sqrt(squared change / squared weights), both summed over the ranks."""
    return float(sums[0].sqrt() / sums[1].sqrt().clamp(min=1e-12))


class UpdateRatio:
    def __init__(self, options: NoOptions) -> None:
        self.saved: list[tuple[str, list[torch.Tensor]]] | None = None
        self.handle: Any = None

    @hookimpl
    def plait_train_start(self, run: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.handle = run.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self.before(run, optimizer))

    @torch.no_grad()
    def before(self, run: Any, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer is about to step: copy the parameters if this step will be logged."""
        if run.is_log_step(run.step + 1):
            self.saved = [(g.get("name", str(i)), [_local(p).detach().clone() for p in g["params"]]) for i, g in enumerate(optimizer.param_groups)]

    @hookimpl
    def plait_metrics(self, run: Any) -> dict[str, Reduced]:
        saved, self.saved = self.saved, None
        if saved is None:
            return {}
        out = {}
        with torch.no_grad():
            for (name, old), group in zip(saved, run.optimizer.param_groups):
                if not group["params"]:
                    continue
                weights = [1.0 / _copies(p, run.dist.world_size) for p in group["params"]]
                new = [_local(p).detach() for p in group["params"]]
                change = torch.stack([w * ((n.float() - o.float()) ** 2).sum() for w, n, o in zip(weights, new, old)]).sum()
                norm = torch.stack([w * (o.float() ** 2).sum() for w, o in zip(weights, old)]).sum()
                out[f"update_ratio/{name}"] = Reduced("sum", torch.stack([change, norm]), finish=_ratio)
        return out

    @hookimpl
    def plait_train_end(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
