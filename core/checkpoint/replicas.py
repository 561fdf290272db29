"""Each rank's share of the replicated state that a save writes.

Under ddp every rank holds the whole model and optimizer state; under HSDP
(fsdp2 with ``replicate`` > 1) every replica group holds the same shards. DCP
writes each replicated tensor, and each repeated shard, once (its planner gives
it to one rank), but an async save copies the state into host memory *before*
that plan exists, so every rank would copy, and keep buffers for, all it holds
(15.2 GB per rank for the ``1b`` flavor under ddp). :func:`share` gives each
rank a state dict holding only what it writes: of the plain tensors, its share
over all ranks; of the DTensor shards, every one its placement gives to it alone
and its share of those repeated over the mesh dimensions it replicates on (the
ranks that hold the same shard split them); both balanced by bytes. DCP's
checkpoint is the same union of chunks: a load on any number of ranks reads
every key from wherever it was written.

A plain (non-DTensor) tensor in a multi-rank state is taken to be the same on
every rank, and a DTensor's local shard the same on the ranks its placements
replicate it over: the assumptions DCP's own de-duplication makes.
:func:`fingerprint` lets the ranks check that they see the same tensors before
they split them.
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


def _dtensors(x: Any, path: Path = ()) -> list[tuple[Path, Any]]:
    """The DTensors reachable through nested dicts."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, dict):
        return [found for k, v in x.items() for found in _dtensors(v, (*path, str(k)))]
    return [(path, x)] if isinstance(x, DTensor) else []


def replica_position(d: Any) -> tuple[tuple[Any, ...], int, int] | None:
    """Where this rank stands among the ranks holding the same local shard of DTensor ``d``:
    ``(group, replicas, index)``; ``group`` names the set of mesh dimensions the shard is repeated
    over (the same on every rank of the mesh), ``replicas`` how many ranks hold it, ``index`` this
    rank's place among them. None if no other rank holds it (no Replicate placement) or this rank
    is not on the mesh."""
    dims = [i for i, p in enumerate(d.placements) if p.is_replicate()]
    coordinate = d.device_mesh.get_coordinate()
    if not dims or coordinate is None:
        return None
    shape = d.device_mesh.shape
    replicas, index = 1, 0
    for i in dims:
        replicas, index = replicas * shape[i], index * shape[i] + coordinate[i]
    return ((tuple(shape), tuple(dims)), replicas, index) if replicas > 1 else None


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.numel() * t.element_size()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without an element size (low-bit states)
        return t.numel()


def balance(sized: list[tuple[int, Path]], holders: int) -> dict[Path, int]:
    """Each path to one of ``holders``: largest first, each to the holder with the fewest bytes so
    far (ties: the lowest); the same wherever the same sizes are seen."""
    load, owner = [0] * holders, {}
    for nbytes, path in sorted(sized, key=lambda bp: (-bp[0], bp[1])):
        holder = min(range(holders), key=lambda h: (load[h], h))
        owner[path] = holder
        load[holder] += nbytes
    return owner


def owners(state: dict[str, Any], world: int) -> dict[Path, int]:
    """The rank that writes each plain tensor (:func:`balance` over all ranks); the same on every
    rank that sees the same tensors."""
    return balance([(_nbytes(t), p) for p, t in _plain_tensors(state)], world)


def dtensor_writers(state: dict[str, Any]) -> dict[Path, bool]:
    """For each DTensor whose local shard other ranks hold too: whether this rank writes it. The
    ranks holding one shard balance the shards they share by bytes (:func:`balance`), and they agree,
    because they hold shards of the same sizes."""
    groups: dict[Any, tuple[int, int, list[tuple[int, Path]]]] = {}
    for path, d in _dtensors(state):
        pos = replica_position(d)
        if pos is not None:
            group, replicas, index = pos
            groups.setdefault(group, (replicas, index, []))[2].append((_nbytes(d.to_local()), path))
    writes = {}
    for replicas, index, sized in groups.values():
        writes.update({path: holder == index for path, holder in balance(sized, replicas).items()})
    return writes


def fingerprint(state: dict[str, Any]) -> int:
    """A 31-bit checksum of the plain tensors' paths, shapes and dtypes and of the DTensors' paths,
    global shapes, dtypes, placements and mesh shapes (not their values): the same on every rank
    that holds the same state."""
    described = sorted(f"{'/'.join(p)}:{tuple(t.shape)}:{t.dtype}" for p, t in _plain_tensors(state))
    described += sorted(f"{'/'.join(p)}:{tuple(d.shape)}:{d.dtype}:{d.placements}:{tuple(d.device_mesh.shape)}" for p, d in _dtensors(state))
    return zlib.crc32("\n".join(described).encode()) & 0x7FFFFFFF


def share(state: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """``state`` without the plain tensors and the repeated DTensor shards another rank writes
    (emptied dicts stay, as empty dicts)."""
    if world == 1:
        return state
    owner = owners(state, world)
    writes = dtensor_writers(state)

    def keep(x: Any, path: Path) -> Any:
        if not isinstance(x, dict):
            return x
        out = {}
        for k, v in x.items():
            here = (*path, str(k))
            if owner.get(here, rank) == rank and writes.get(here, True):
                out[k] = keep(v, here)
        return out

    return keep(state, ())


def agreed_share(state: dict[str, Any], rank: int, world: int, agree: Callable[[int, str], int]) -> dict[str, Any] | None:
    """:func:`share`, once every rank has the same :func:`fingerprint` (``agree(value, "min")``: the
    minimum over the ranks, a collective every rank calls); None, on every rank, if any differs."""
    mine = fingerprint(state)
    same = agree(int(agree(mine, "min") == mine), "min")
    return share(state, rank, world) if same else None
