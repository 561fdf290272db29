"""Process-group setup: gloo on CPU, nccl on CUDA, from torchrun's environment."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from core.contract.protocols import DistInfo


def env_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables; (0, 1, 0) without torchrun."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


_timeout = datetime.timedelta(seconds=1800)  # init's, for the control plane's own group too


def init(preference: str = "auto", timeout_s: int = 1800, tp: int = 1, pp: int = 1) -> DistInfo:
    """The process group of torchrun's ranks; ``tp``: ranks of one tensor-parallel group; ``pp``: pipeline stages."""
    global _timeout
    rank, world, local = env_world()
    _timeout = datetime.timedelta(seconds=timeout_s)
    device = pick_device(preference, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "none"
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            timeout=_timeout,
            device_id=device if device.type == "cuda" else None,
        )
    elif dist.is_initialized():
        backend = dist.get_backend()
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=device, backend=backend, tp=tp, pp=pp)


def gloo_group():
    """A gloo group of all ranks, with the run's collective timeout (torch's default is 30 minutes)."""
    return dist.new_group(backend="gloo", timeout=_timeout)


# How ranks agree (:func:`agree`): a number reduced over the ranks, or every rank's small object.
AGREE_MODES = ("max", "min", "sum", "all", "root")


def agree(value: Any, mode: str, group: Any) -> Any:
    """What every rank of ``group`` gets back, the same on each, in one host-side collective.

    * ``"max"``, ``"min"``, ``"sum"``: ``value`` is a number or a list of numbers, every rank giving
      as many; each is reduced over the ranks (``max`` of flags: any rank's; ``min``: the smallest
      rank's answer; ``sum``: a count over ranks), in int64, or float64 when any is a float. The
      same shape comes back.
    * ``"all"``: every rank's ``value`` (small, picklable), in rank order.
    * ``"root"``: rank 0's ``value``.

    ``group`` is the process group of the ranks that agree (``torch.distributed.group.WORLD`` for
    all of them); None, or a group of one, is this process alone, which gets its own value back. A
    per-step flag that must stay on the device (the non-finite skip, :mod:`core.loop.nonfinite`)
    is a device all-reduce instead: agreeing on the host would sync the device every step.
    """
    if mode not in AGREE_MODES:
        raise ValueError(f"agree: mode {mode!r}; expected one of {', '.join(AGREE_MODES)}")
    world = 1 if group is None else dist.get_world_size(group)
    if mode == "all":
        out = [value] * world
        if world > 1:
            dist.all_gather_object(out, value, group=group)
        return out
    if world == 1:
        return value
    if mode == "root":
        box = [value]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    dtype = torch.float64 if any(isinstance(v, float) for v in values) else torch.int64
    t = torch.tensor(values, dtype=dtype)
    dist.all_reduce(t, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}[mode], group=group)
    out = t.tolist()
    return out if isinstance(value, (list, tuple)) else out[0]


class ControlPlane:
    """The run's ranks agreeing on small host-side values (stop flags, reasons), on a gloo group
    (:func:`agree`). On CUDA this avoids a device sync per step; on CPU it is the default group."""

    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self.group = None
        if info.world_size > 1:
            self.group = gloo_group() if info.backend == "nccl" else dist.group.WORLD

    def agree(self, value: Any, mode: str) -> Any:
        """:func:`agree` over every rank of the run."""
        return agree(value, mode, self.group)

    def barrier(self) -> None:
        if self.info.world_size > 1:
            dist.barrier(group=self.group)


def mean_across_ranks(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.world_size > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= info.world_size
    return t


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
