"""Choosing and loading the checkpoint to resume from, once the process group exists.

``preflight.prepare`` (before any process group) lists the candidates
(:func:`checkpointing.folders.find_resume`): an explicit path, or the committed
checkpoints newest first, the first of them checked except for its shards.
Here every rank takes part, and all ranks agree on every outcome:

1. :func:`first_sound`: each rank checks its share of the DCP shards against
   their checksums (each byte is read by one rank), the small files, and the
   JSON files that it alone will read (its RNG and data position); a failure
   on any rank drops the candidate on all of them.
2. :func:`restore`: the load itself, which can still fail (a DCP load error,
   a refused item, a state.json value the trainer cannot take). A failure on
   any rank drops the candidate on all, and the trainer builds its state
   again before the next one: a half-done load must not leak into a fresh start.

With ``resume = "auto"`` a dropped candidate is one warning line on rank 0 and
the next one is tried; when none is left the run starts fresh and says so. An
explicit path that fails is an error (exit code 2, one line from rank 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from checkpointing import integrity
from checkpointing.folders import check_fits, read_json, read_manifest, verify, warn
from checkpointing.rng import set_rng_state
from core.errors import EXIT_BAD_INPUT, CheckpointError


def agree(group: Any, error: str | None) -> str | None:
    """The first rank's error, on every rank (``None`` if all succeeded)."""
    if group is None:
        return error
    import torch.distributed as tdist

    errors: list[str | None] = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e), None)


def check_here(ckpt: Any, path: Path) -> None:
    """This rank's part of checking candidate ``path``. Raises CheckpointError."""
    rank, world = ckpt.dist.rank, ckpt.dist.world_size
    state = verify(path, shards=False)
    manifest = read_manifest(path)
    integrity.check_checksums(path, manifest, integrity.share(manifest.shards(), manifest.sizes, rank, world))
    if state["world_size"] == world:
        rng = path / "rng" / f"rank_{rank}.json"
        if rng.is_file() and "rng" not in ckpt.opts.exclude_from_loading:
            try:
                set_rng_state(read_json(rng))  # a trial: the trainer seeds its state afresh after this
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - valid JSON, not an RNG state
                raise CheckpointError(f"{rng} is not an RNG state ({type(e).__name__}: {e})") from None
        data = path / "rng" / f"data_rank_{rank}.json"
        if data.is_file():
            read_json(data)


def first_sound(ckpt: Any, candidates: list[Path], model_meta: torch.nn.Module | None) -> tuple[Path | None, list[Path]]:
    """The first candidate that every rank finds sound, and the ones after it. Rank 0's list is
    every rank's: it was made once rank 0 held the folder's lock (the others' may be older)."""
    if ckpt.group is not None:
        import torch.distributed as tdist

        box = [[str(p) for p in candidates]]
        tdist.broadcast_object_list(box, src=0, group=ckpt.group)
        candidates = [Path(p) for p in box[0]]
    for i, path in enumerate(candidates):
        error = None
        try:
            check_here(ckpt, path)
        except CheckpointError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - every rank must reach agree(), whatever went wrong here
            error = one_line(path, "could not be checked", e)
        error = agree(ckpt.group, error)
        if error is None:
            check_fits(ckpt.opts, path, model_meta)
            return path, candidates[i + 1 :]
        drop(ckpt, error, last=i == len(candidates) - 1)
    return None, []


def restore(ckpt: Any, path: Path, last: bool) -> bool:
    """Load ``path`` into the trainer; False (on every rank) if it failed anywhere."""
    error = None
    try:
        ckpt.load(path)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - whatever the trainer could not take
        error = one_line(path, "could not be loaded", e)
    error = agree(ckpt.group, error)
    if error is None:
        return True
    drop(ckpt, error, last)
    return False


def leave_branch(ckpt: Any, path: Path) -> None:
    """After resuming from ``path``: this run's later checkpoints are a branch it leaves; rank 0
    moves them aside (:func:`checkpointing.retention.set_aside_later`). A failed move stops every rank
    (CheckpointError on rank 0): the new branch's saves would be pruned beside them."""
    from checkpointing.retention import set_aside_later

    error = None
    if ckpt.dist.is_main:
        try:
            set_aside_later(ckpt.root, ckpt.lineage, path, ckpt.state.run.step, chosen=ckpt.opts.resume != "auto")
        except OSError as e:
            error = f"resumed from {path}, but could not move this run's later checkpoints aside ({e}); move them out of {ckpt.root} and start again"
    error = agree(ckpt.group, error)
    if error is not None:
        stop_every_rank(ckpt, error)


def stop_every_rank(ckpt: Any, error: str) -> None:
    """End the run on every rank with exit code 2: rank 0 raises ``error`` (one line), the others exit quietly."""
    if ckpt.dist.is_main:
        raise CheckpointError(error)
    raise SystemExit(EXIT_BAD_INPUT)  # rank 0 says why, once


def one_line(path: Path, what: str, error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"checkpoint {path} {what}: {type(error).__name__}: {text[0] if text else ''}"


def drop(ckpt: Any, error: str, last: bool) -> None:
    """A candidate failed on some rank: warn and go on (auto), or end the run (an explicit path)."""
    if ckpt.opts.resume != "auto":
        stop_every_rank(ckpt, error)
    warn(f"skipping checkpoint: {error}")
    if last:
        warn(f"no usable checkpoint in {ckpt.root}: starting fresh")
