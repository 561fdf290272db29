"""Room on the disk for the run's checkpoints, checked at the start rather than found missing at the
first save, hours of training later (a full disk then stops the run with exit 74)."""

from __future__ import annotations

import shutil
from pathlib import Path

from torch import nn

from core.contract import log
from core.contract.errors import ConfigError

GiB = 2**30


def size_text(n: float) -> str:
    return f"{n / GiB:,.2f} GiB" if n >= GiB else f"{n / 2**20:,.1f} MiB"


def checkpoint_bytes(model_meta: nn.Module, optimizer_state_bytes_per_param: float) -> int:
    """About what one checkpoint writes, over all ranks: the model's state dict in fp32 (a tied weight
    once per name, as DCP stores it) and the optimizer's state."""
    saved = sum(t.numel() for t in model_meta.state_dict().values())
    params = sum(p.numel() for p in {id(p): p for p in model_meta.parameters()}.values())
    return int(saved * 4 + params * optimizer_state_bytes_per_param)


def free_bytes(folder: Path) -> int | None:
    """Free bytes on the filesystem that holds ``folder`` (or would: its nearest existing parent)."""
    p = folder.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:  # a filesystem that does not say
        return None


def check_room(root: Path, size: int, kept: int, kept_now: int, what: str) -> None:
    """Refuse a run whose checkpoint folder cannot hold one checkpoint; warn when it cannot hold the
    ``kept`` this run keeps at once (``kept_now`` of them are on the disk already)."""
    free = free_bytes(root)
    if free is None or size <= 0:
        return
    if free < size:
        raise ConfigError(
            f"{what} = {root}: {size_text(free)} free on its filesystem; one checkpoint of this run needs about "
            f"{size_text(size)} (fp32 weights and the optimizer's state): free some space or point checkpoint.dir elsewhere"
        )
    room = free // size + kept_now
    if room < kept:
        log.warn(
            f"{what} = {root}: {size_text(free)} free holds {free // size:,} more checkpoint(s) of about {size_text(size)}; "
            f"this run keeps up to {kept:,} at once: the disk may fill before the run ends (a save that finds it full stops the run, exit 74)"
        )
