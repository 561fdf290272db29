"""Each rank's share of the replicated state that a save writes.

Under ddp every rank holds the whole model and optimizer state. DCP writes each
replicated tensor once (its planner gives it to one rank), but an async save
copies the state into host memory *before* that plan exists, so every rank
would copy, and keep buffers for, all of it (15.2 GB per rank for the ``1b``
flavor). :func:`share` gives each rank a state dict holding only the plain
tensors it writes, balanced by bytes, and every DTensor shard (fsdp2 already
splits those). DCP's checkpoint is the same union of tensors: a load on any
number of ranks reads every key from wherever it was written.

A plain (non-DTensor) tensor in a multi-rank state is taken to be the same on
every rank, the assumption DCP's own de-duplication makes. :func:`fingerprint`
lets the ranks check that they see the same tensors before they split them.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

import torch

Path = tuple[str, ...]


def _plain_tensors(x: Any, path: Path = ()) -> list[tuple[Path, torch.Tensor]]:
    """The plain tensors reachable through nested dicts (list items are kept on every rank)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, dict):
        return [found for k, v in x.items() for found in _plain_tensors(v, (*path, str(k)))]
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        return [(path, x)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.numel() * t.element_size()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without an element size (low-bit states)
        return t.numel()


def owners(state: dict[str, Any], world: int) -> dict[Path, int]:
    """The rank that writes each plain tensor: largest first, each to the rank with the fewest bytes
    so far (ties: the lowest rank); the same on every rank that sees the same tensors."""
    sized = sorted(((_nbytes(t), p) for p, t in _plain_tensors(state)), key=lambda bp: (-bp[0], bp[1]))
    load, owner = [0] * world, {}
    for nbytes, path in sized:
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[path] = rank
        load[rank] += nbytes
    return owner


def fingerprint(state: dict[str, Any]) -> int:
    """A 31-bit checksum of the plain tensors' paths, shapes and dtypes (not their values)."""
    described = sorted(f"{'/'.join(p)}:{tuple(t.shape)}:{t.dtype}" for p, t in _plain_tensors(state))
    return zlib.crc32("\n".join(described).encode()) & 0x7FFFFFFF


def share(state: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """``state`` without the plain tensors another rank writes (emptied dicts stay, as empty dicts)."""
    if world == 1:
        return state
    owner = owners(state, world)

    def keep(x: Any, path: Path) -> Any:
        if not isinstance(x, dict):
            return x
        out = {}
        for k, v in x.items():
            here = (*path, str(k))
            if owner.get(here, rank) == rank:
                out[k] = keep(v, here)
        return out

    return keep(state, ())


def agreed_share(state: dict[str, Any], rank: int, world: int, agree: Callable[[int, str], int]) -> dict[str, Any] | None:
    """:func:`share`, once every rank has the same :func:`fingerprint` (``agree(value, "min")``: the
    minimum over the ranks, a collective every rank calls); None, on every rank, if any differs."""
    mine = fingerprint(state)
    same = agree(int(agree(mine, "min") == mine), "min")
    return share(state, rank, world) if same else None
