"""A monitor's values reduced over the ranks by the core, never by the monitor's own collective.

A monitor that issues a collective of its own in ``plait_metrics`` and fails on one rank before
reaching it (or is disabled there by an earlier failure) leaves the other ranks waiting in it until
the collective timeout: the ranks' collectives would not match. So a monitor returns
:class:`Reduced` values instead (``core.api.Reduced``). Once every monitor's ``plait_metrics`` has
run, :func:`reduce_monitor_values` makes every rank agree on what to reduce (each rank's names,
ops and shapes, one small gather) and reduces it in one more collective
(:func:`core.contract.metrics.reduce_parts`). Every rank calls it once per log step whatever its monitors
did, so no failure leaves a rank waiting. When the ranks disagree (a monitor failed, or returned
other names, on some rank) nothing is reduced: those metrics are left out of the step on every rank,
said once, and the failure itself stops the run as any monitor's does (``monitors.on_error``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeGuard

import torch
import torch.distributed as torch_dist

from core.contract import log
from core.contract.metrics import REDUCTIONS, reduce_parts
from core.contract.protocols import DistInfo
from core.runtime.distributed import agree

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

MAX_ELEMENTS = 2**16  # a Reduced value's most elements: a metric, not a model's tensor (every rank gathers every rank's; metrics.jsonl writes them all)


@dataclass(frozen=True)
class Reduced:
    """A metric a monitor returns from ``plait_metrics`` for the core to reduce over the ranks:
    ``op`` is ``mean``, ``sum``, ``max`` or ``min``; ``value`` a number or a tensor (the same shape
    on every rank, at most :data:`MAX_ELEMENTS` elements; a larger one is left out with a warning).
    The step's metrics hold the reduced value (a float for one element), or ``finish(reduced value)``
    when a ``finish`` is given: a metric that is a function of sums over the ranks (``update_ratio``'s
    sqrt(sum of squared changes / sum of squared weights), one tensor of both summed). A ``finish``
    that raises leaves the metric out, with a warning."""

    op: str
    value: Any
    finish: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if self.op not in REDUCTIONS:
            raise ValueError(f"Reduced: op {self.op!r}; expected one of {', '.join(REDUCTIONS)}")


def squared_norm_share(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """This rank's share of ``tensor``'s squared L2 norm (a parameter, or its ``.grad``): summed over
    the ranks (``Reduced("sum", share)``), the shares give the whole tensor's squared norm under every
    parallelism. A plain tensor is held whole by every rank (one process; ddp's replicas, and its
    gradients once reduced), so each of the ``world_size`` ranks counts ``1 / world_size`` of it. An
    fsdp2 parameter is a ``DTensor``: this rank counts its local shard, divided by the number of ranks
    holding that same shard (HSDP's replicas). Returns a 0-dim float32 tensor on the tensor's device;
    no collective, no host sync."""
    local = tensor.to_local() if _is_dtensor(tensor) else tensor
    share = local.detach().float().square().sum()
    return share / _copies(tensor, world_size)


def _is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor, without importing ``torch.distributed.tensor`` (no DTensor
    exists before it is loaded; loading it costs a command that reads the plugins about a CPU-second)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _copies(tensor: torch.Tensor, world_size: int) -> int:
    """How many ranks hold this rank's part of ``tensor``: a plain tensor is on every rank; a DTensor's
    part is repeated over the mesh dims it is replicated on."""
    if not _is_dtensor(tensor):
        return world_size
    return math.prod(tensor.device_mesh.size(dim) for dim, placement in enumerate(tensor.placements) if placement.is_replicate())


def reduce_monitor_values(metrics: dict[str, Any], dist: DistInfo) -> dict[str, Any]:
    """``metrics`` with each :class:`Reduced` value reduced over the ranks (a collective on every rank
    of several: call it once per log step on each). Left out on every rank when the ranks disagree."""
    parts: dict[str, tuple[str, torch.Tensor]] = {}
    finishes = {name: v.finish for name, v in metrics.items() if isinstance(v, Reduced) and v.finish is not None}
    not_numbers = []
    for name, v in metrics.items():
        if isinstance(v, Reduced):
            try:  # whatever a monitor's value does, never raised here: the other ranks would wait
                t = torch.as_tensor(v.value, dtype=torch.float64).detach().to_dense()  # a sparse tensor made dense
                if t.is_meta or t.numel() > MAX_ELEMENTS:
                    raise ValueError(f"{'a meta tensor' if t.is_meta else f'{t.numel()} values, more than {MAX_ELEMENTS}'}")
                parts[name] = (v.op, t)
            except Exception as e:  # TypeError, ValueError, RuntimeError; OverflowError for an int beyond a float
                not_numbers.append(name)
                log.warn(
                    f"monitor metric {name!r}: Reduced({v.op!r}, {type(v.value).__name__}) holds no number or tensor: left out ({type(e).__name__}: {e})",
                    once=f"not-reducible-{name}",
                )
    plain = {k: v for k, v in metrics.items() if not isinstance(v, Reduced)}
    if dist.world_size > 1 and torch_dist.is_initialized():
        layout = [(name, op, tuple(t.shape)) for name, (op, t) in parts.items()] + [(name, "", None) for name in not_numbers]
        everyone: list[Any] = agree(layout, "all", torch_dist.group.WORLD)
        if any(other != layout for other in everyone):
            differ = [r for r, other in enumerate(everyone) if other != everyone[0]]
            log.warn(
                f"monitor metrics to reduce differ between ranks (rank 0 and rank {differ[0]}: a monitor failed or returned other names): "
                "left out on every rank",
                once="monitor-reductions-differ",
            )
            return plain
    if not parts:
        return plain
    reduced = reduce_parts({k: (op, t.to(dist.device)) for k, (op, t) in parts.items()}, dist)
    out = {k: float(v) if v.numel() == 1 else v for k, v in reduced.items()}
    for name, finish in finishes.items():
        if name in out:
            try:
                out[name] = finish(out[name])
            except Exception as e:  # noqa: BLE001 - a metric left out, never a rank that stops alone
                del out[name]
                log.warn(f"monitor metric {name!r}: its Reduced finish raised {type(e).__name__}: {e}; left out", once=f"finish-{name}")
    return {**plain, **out}
