"""Choosing and loading the checkpoint to resume from, once the process group exists.

``core.preflight.prepare`` (before any process group) lists the candidates
(:func:`core.checkpoint.folders.find_resume`): an explicit path, or the committed
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

A load that fails because this run's config cannot continue the checkpoint (a
``ConfigError`` or ``DataError``: a data source whose position is of another kind,
a mixture with other stages) is not damage: every older checkpoint of the run
would fail the same way, and falling back past them all would start the run
afresh, a new lineage whose saves skip the old run's steps. It ends the run on
every rank with exit code 2 and one line, whatever ``resume`` says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from core.checkpoint import integrity
from core.checkpoint.folders import check_fits, read_json, read_manifest, verify, warn
from core.checkpoint.rng import set_rng_state
from core.contract import log
from core.contract.errors import EXIT_BAD_INPUT, CheckpointError, ConfigError, DataError
from core.runtime import distributed


def agree(group: Any, error: str | None, bad_input: bool = False) -> str | None:
    """The first rank's error, on every rank (``None`` if all succeeded). An error a rank marked
    ``bad_input`` comes back as :class:`BadInput` (a ``str``), first among the ranks that had one."""
    errors: list[tuple[str | None, bool]] = distributed.agree((error, bad_input), "all", group)
    first = next((e for e, bad in errors if e and bad), None)
    return BadInput(first) if first else next((e for e, _ in errors if e), None)


class BadInput(str):
    """An agreed error that is this run's config, not the checkpoint's damage (exit code 2)."""


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


def first_sound(
    ckpt: Any, candidates: list[Path], model_meta: torch.nn.Module | None, architecture: dict[str, Any] | None = None
) -> tuple[Path | None, list[Path]]:
    """The first candidate that every rank finds sound, and the ones after it, held to this run's
    model (``architecture``, :mod:`core.checkpoint.architecture`, and shapes). Rank 0's list is
    every rank's: it was made once rank 0 held the folder's lock (the others' may be older)."""
    candidates = [Path(p) for p in distributed.agree([str(p) for p in candidates], "root", ckpt.group)]
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
            check_fits(ckpt.opts, path, model_meta, architecture)
            return path, candidates[i + 1 :]
        drop(ckpt, error, last=i == len(candidates) - 1)
    return None, []


def restore(ckpt: Any, path: Path, last: bool) -> bool:
    """Load ``path`` into the trainer; False (on every rank) if it failed anywhere."""
    error, bad_input = None, False
    try:
        ckpt.load(path)
    except (ConfigError, DataError) as e:  # this config cannot continue it: the user's to fix, not damage
        error, bad_input = str(e) if str(e).startswith(f"checkpoint {path}") else f"checkpoint {path}: {e}", True
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - whatever the trainer could not take
        error = one_line(path, "could not be loaded", e)
    error = agree(ckpt.group, error, bad_input)
    if error is None:
        return True
    if isinstance(error, BadInput):  # never a fallback: every older checkpoint of the run would fail alike
        stop_every_rank(ckpt, error)
    drop(ckpt, error, last)
    return False


def check_data_position(path: Path, meta: dict[str, Any], config: dict[str, Any], per_rank: bool, rank: int, world: int) -> None:
    """The data position ``path`` holds must be of the kind this run's loader keeps (``per_rank``: a
    stream's position per rank, else a global sample index), and a stream's must come from this
    world size. A mismatch is this run's config (ConfigError), a missing file of its own the
    checkpoint's damage (CheckpointError)."""
    saved_per_rank = (path / "rng" / "data_rank_0.json").is_file()
    was = meta.get("config", {}).get("data", {}).get("name") if isinstance(meta.get("config"), dict) else None
    now = config.get("data", {}).get("name")
    fix = f"resume with [data] name = {was!r} as saved, or set --checkpoint.exclude_from_loading='[\"data\"]' to start the data over"
    if per_rank and not saved_per_rank:
        raise ConfigError(
            f"checkpoint {path} holds a global data position (sample {meta.get('data', {}).get('consumed_samples', '?')}) of data source {was!r}; "
            f"this run's data source {now!r} streams, with a position per rank, and cannot continue from it: {fix}"
        )
    if saved_per_rank and not per_rank:
        raise ConfigError(
            f"checkpoint {path} holds the per-rank stream positions of data source {was!r}; this run's data source {now!r} "
            f"keeps a global sample index and cannot continue from them: {fix}"
        )
    if per_rank:
        check_stream_world(path, meta, world)
    if per_rank and not (path / "rng" / f"data_rank_{rank}.json").is_file():
        raise CheckpointError(f"checkpoint {path} lacks rng/data_rank_{rank}.json, its stream position for rank {rank}")


def check_stream_world(path: Path, meta: dict[str, Any], world: int) -> None:
    """Per-rank stream positions (a loader's ``per_rank_state``) resume only at the world size that saved
    them, whatever this run's loader; also checked before training (:mod:`core.preflight.start_folders`), so
    ``core.plan`` says it and no model is built for a start that must be refused."""
    saved_world = meta.get("world_size")
    if (path / "rng" / "data_rank_0.json").is_file() and saved_world != world:
        raise ConfigError(
            f"checkpoint {path}: the streaming data position was saved on {saved_world} ranks and cannot resume on {world} "
            "(resume at that world size, or --checkpoint.exclude_from_loading='[\"data\"]' to start the data over)"
        )


def leave_branch(ckpt: Any, path: Path, passed_over: str = "") -> None:
    """After resuming from ``path``: this run's later checkpoints are a branch it leaves; rank 0
    moves them aside (:func:`core.checkpoint.retention.set_aside_later`; ``passed_over``: why
    ``resume = "auto"`` went back past them). A failed move stops every rank (CheckpointError on
    rank 0): the new branch's saves would be pruned beside them."""
    from core.checkpoint.retention import set_aside_later

    error = None
    if ckpt.dist.is_main:
        try:
            set_aside_later(ckpt.root, ckpt.lineage, path, ckpt.state.run.step, chosen=ckpt.opts.resume != "auto", passed_over=passed_over)
        except OSError as e:
            error = f"resumed from {path}, but could not move this run's later checkpoints aside ({e}); move them out of {ckpt.root} and start again"
    error = agree(ckpt.group, error)
    if error is not None:
        stop_every_rank(ckpt, error)


def set_aside_unusable(ckpt: Any) -> None:
    """A ``resume = "auto"`` start that resumed nothing although the run that last trained in the folder
    (``CURRENT_RUN``; every run where none is recorded) left committed checkpoints: each was skipped as
    damaged or unloadable. Rank 0 moves them to ``abandoned/<utc>_unusable/`` (kept, never deleted)
    before the first step, so the fresh start's saves of the same steps are not skipped as another
    run's: no more than ``checkpoint.every`` steps are ever lost. A failed move stops every rank."""
    from core.checkpoint.folders import committed, current_run, lineage_of
    from core.checkpoint.retention import set_aside

    error = None
    if ckpt.dist.is_main and ckpt.opts.resume == "auto":
        before = current_run(ckpt.root)
        unusable = [p for p in committed(ckpt.root) if before is None or lineage_of(p) == before]
        if unusable:
            try:
                dest = set_aside(ckpt.root, unusable, "unusable")
                log.note(
                    f"the {len(unusable)} checkpoint(s) that could not be resumed ({unusable[0].name} to {unusable[-1].name}) are moved to {dest}: this fresh start saves in their place"
                )
            except OSError as e:
                error = f"no checkpoint in {ckpt.root} could be resumed, and moving them aside failed ({e}); move them out of {ckpt.root} and start again"
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
