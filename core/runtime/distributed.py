"""Process-group setup: gloo on CPU, nccl on CUDA, from torchrun's environment."""

from __future__ import annotations

import datetime
import os

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


def init(preference: str = "auto", timeout_s: int = 1800) -> DistInfo:
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
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=device, backend=backend)


def gloo_group():
    """A gloo group of all ranks, with the run's collective timeout (torch's default is 30 minutes)."""
    return dist.new_group(backend="gloo", timeout=_timeout)


class ControlPlane:
    """Small host-side integer all-reduces (stop flags) on a gloo group.

    On CUDA this avoids a device sync per step; on CPU it is the default group.
    """

    def __init__(self, info: DistInfo) -> None:
        self.info = info
        self.group = None
        if info.world_size > 1:
            self.group = gloo_group() if info.backend == "nccl" else dist.group.WORLD

    def max(self, values: list[int]) -> list[int]:
        if self.info.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def broadcast_object(self, obj):
        if self.info.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (small, picklable), in rank order, on every rank."""
        out = [obj] * self.info.world_size
        if self.info.world_size > 1:
            dist.all_gather_object(out, obj, group=self.group)
        return out

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
