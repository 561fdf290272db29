"""Checkpoint folders: their layout, their verification, and which one to resume from.

A checkpoint is a folder ``<dir>/step_000001000/`` holding

* the DCP shards of ``{"model": ..., "optimizer": ...}``, written by every
  rank and resharded on load, so a checkpoint made on N ranks (ddp or fsdp2)
  loads on M ranks;
* ``state.json``: step, tokens seen, wall time, best validation loss, the LR
  schedule, the data position (global, so it is independent of world size),
  the optimizer plugin's name, the resolved config and library versions;
* ``rng/rank_<r>.json``: python, numpy, torch and cuda RNG states per rank;
* ``COMMITTED``: written last, by rank 0, once every rank has finished
  writing; it lists every file with its size and CRC-32 (each rank checksums
  its shards while writing them, :mod:`core.checkpoint.safe_dcp`). A folder without it,
  or whose files do not match it, is never resumed from (:mod:`core.checkpoint.integrity`).

Checkpoints are read only through :class:`core.checkpoint.safe_dcp.SafeFileSystemReader`,
which runs no code from the files. Writing and loading them is
:class:`core.checkpoint.checkpointer.Checkpointer`'s job; nothing here needs a process group.
"""

from __future__ import annotations

import os
import re
import stat
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch

from core.checkpoint import integrity
from core.config.sections import CheckpointOptions
from core.contract import log
from core.contract.errors import CheckpointError, ConfigError
from core.runtime.small_files import read_json as read_small_json
from core.runtime.small_files import read_text

COMMIT_MARKER = "COMMITTED"
BEST_FILE = "BEST.json"  # lists the checkpoints with the best values of checkpoint.best_metric (checkpoint.keep_best)
STATE_FILE = "state.json"
CHECKPOINT_FORMAT = 1  # state.json's "format": raised when a change to the layout would mislead an older plait
SETTING_ASIDE_FILE = "SETTING_ASIDE.json"  # the folders being moved to abandoned/, while they are (core.checkpoint.retention)
LINEAGE_FILE = "LINEAGE"  # the run (lineage id) that wrote this folder; written first, before any shard
CURRENT_RUN_FILE = "CURRENT_RUN"  # the lineage of the run that last trained into this folder: resume = "auto" continues it
STEP_DIR = re.compile(r"step_\d{9}")  # step_dir()'s names; a user's step_000000005_keep is not a checkpoint of plait's
EXIT_SAVE_FAILED = 74  # a save could not be written (disk full, I/O error); sysexits' EX_IOERR
# A single process saving or loading without a process group is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class SaveFailed(Exception):
    """A checkpoint could not be written (disk full, quota, I/O error). Raised on every rank
    together, after the partial folder of this save was removed; the run stops without a
    checkpoint and exits with :data:`EXIT_SAVE_FAILED`."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


# torch's zip writer reports a failed write (ENOSPC, EFBIG) as a RuntimeError; once DCP has
# pickled it across ranks its OSError context is gone, so it is recognised by its text.
_WRITER_ERRORS = ("inline_container.cc", "PytorchStreamWriter", "file write failed")


def io_error(e: BaseException, depth: int = 0) -> BaseException | None:
    """The write error behind a failed save: an OSError (``e`` itself, its context, or one
    inside DCP's ``CheckpointException``, a BaseException carrying each failing rank's
    error), or torch's file writer's RuntimeError for a failed write. None for anything else."""
    if isinstance(e, OSError):
        return e
    if depth > 4:
        return None
    for failure in (getattr(e, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException) and (found := io_error(inner, depth + 1)) is not None:
            return found
    cause = e.__cause__ or e.__context__
    if cause is not None and (found := io_error(cause, depth + 1)) is not None:
        return found
    if isinstance(e, RuntimeError) and any(m in str(e) for m in _WRITER_ERRORS):
        return e
    return None


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


def step_dirs(root: Path) -> list[Path]:
    """The folders in ``root`` named as plait names its checkpoints (:func:`step_dir`), oldest first."""
    if not root.is_dir():
        return []
    with os.scandir(root) as entries:  # the entries' types come with the listing: no stat per folder
        return sorted(root / e.name for e in entries if STEP_DIR.fullmatch(e.name) and e.is_dir())


def checkpoint_holding(path: Path) -> Path | None:
    """The plait checkpoint folder that ``path`` is, or lies in (a ``step_`` folder with a ``LINEAGE`` or
    ``COMMITTED`` file); None if none. Pruning deletes such a folder whole, whatever else it holds."""
    here = Path(os.path.abspath(path))
    for p in [here, *here.parents]:
        if STEP_DIR.fullmatch(p.name) and ((p / LINEAGE_FILE).is_file() or (p / COMMIT_MARKER).is_file()):
            return p
    return None


def marked(path: Path) -> bool:
    """Whether checkpoint folder ``path`` has its commit marker. A folder that cannot be looked into
    (no read permission, as on NFS with root squash) counts as marked: :func:`verify` then names it
    unreadable, and ``resume = "auto"`` skips it with a line, rather than passing over it unsaid."""
    try:
        return stat.S_ISREG(os.stat(path / COMMIT_MARKER).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True


def committed(root: Path) -> list[Path]:
    """Folders with a commit marker, oldest first (by step)."""
    return [p for p in step_dirs(root) if marked(p)]


def committed_newest_first(root: Path) -> Iterator[Path]:
    """:func:`committed`, newest first, each folder's marker looked at only when it is reached: a
    save that wants the newest ones reads nothing of the many older ones ``keep_latest = 0`` keeps."""
    return (p for p in reversed(step_dirs(root)) if marked(p))


def lineage_of(path: Path) -> str | None:
    """The id of the run that wrote checkpoint folder ``path``; None if unknown (another tool, or plait before lineages)."""
    try:
        return read_text(path / LINEAGE_FILE).strip() or None
    except (OSError, ValueError):  # unreadable or not text (damaged): whose it is, is unknown
        return None


def current_run(root: Path) -> str | None:
    """The lineage of the run that last trained into ``root`` (``CURRENT_RUN``); None if none is recorded."""
    try:
        return read_text(root / CURRENT_RUN_FILE).strip() or None
    except (OSError, ValueError):
        return None


def refuse_foreign(opts: CheckpointOptions, root: Path) -> None:
    """A fresh run must not share a checkpoint folder with another run's checkpoints unless told to."""
    if opts.resume != "none" or opts.allow_foreign:
        return
    theirs = committed(root)
    if theirs:
        raise CheckpointError(
            f"checkpoint folder {root} holds {len(theirs)} checkpoint(s) of another run (newest {theirs[-1].name}) and "
            "checkpoint.resume = 'none' starts a new one: resume it (resume = 'auto'), use another checkpoint.dir or "
            "train.output_dir, or set checkpoint.allow_foreign = true to train beside them (they are never touched)"
        )


def read_manifest(path: Path) -> integrity.Manifest:
    """The commit manifest of checkpoint folder ``path``. Raises CheckpointError."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    marker = path / COMMIT_MARKER
    if not marked(path):
        raise CheckpointError(folder_of_checkpoints(path) or f"checkpoint {path} is incomplete: no {COMMIT_MARKER} marker (interrupted save?)")
    return integrity.read_manifest(marker)


def folder_of_checkpoints(path: Path) -> str:
    """The error for a folder of checkpoints, or a run's output folder, given where one checkpoint was
    expected (the folder a user has at hand): it names the newest committed checkpoint in it; '' if none."""
    for root, what in ((path, "a folder of checkpoints"), (path / "checkpoints", "a run's output folder")):
        newest = next(committed_newest_first(root), None)
        if newest is not None:
            return f"{path} is {what}, not a checkpoint: give one checkpoint folder, e.g. its newest, {newest}"
    return ""


def verify(path: Path, shards: bool = True) -> dict[str, Any]:
    """Check that ``path`` is a complete, undamaged checkpoint; return its state.json.

    Checks every listed file's size and checksum, that the DCP metadata is
    made of nothing but DCP metadata (:mod:`core.checkpoint.safe_dcp`), and that
    state.json has the keys a resume reads. ``shards=False`` leaves out the
    checksums of the DCP shards (the bulk of the bytes): a resume checks those
    after the process group exists, each rank a share (:mod:`core.checkpoint.resume`).
    Raises CheckpointError.
    """
    try:
        return _verify(path, shards)
    except OSError as e:  # no read permission (NFS root squash), an I/O error: not a checkpoint to use
        where = f"{e.filename}" if e.filename else str(path)
        raise CheckpointError(f"checkpoint {path} is unreadable: {where}: {e.strerror or e}") from None


def _verify(path: Path, shards: bool) -> dict[str, Any]:
    from core.checkpoint.safe_dcp import load_metadata

    refuse_newer_format(path)
    manifest = read_manifest(path)
    integrity.check_sizes(path, manifest, exclude=COMMIT_MARKER)
    integrity.check_checksums(path, manifest, manifest.small_files() + (manifest.shards() if shards else []))
    load_metadata(path)
    try:
        state = read_small_json(path / STATE_FILE)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is corrupt ({e})") from None
    integrity.check_state(state, path / STATE_FILE)
    return state


def refuse_newer_format(path: Path) -> None:
    """A checkpoint a newer plait wrote in a layout this one does not know is bad input (exit 2),
    never "damaged": ``resume = "auto"`` would fall back past it, or start fresh, and set it aside."""
    try:
        state = read_small_json(path / STATE_FILE)
        fmt, versions = state.get("format", 1), state.get("versions", {})
    except (OSError, ValueError, AttributeError):  # verify says what is wrong with it
        return
    if isinstance(fmt, int) and fmt > CHECKPOINT_FORMAT:
        by = f"plait {versions.get('plait')}" if isinstance(versions, dict) and versions.get("plait") else "a newer plait"
        raise ConfigError(
            f"checkpoint {path} is in checkpoint format {fmt}, written by {by}; this plait reads format {CHECKPOINT_FORMAT} "
            "and older: resume it with a plait at least as new"
        )


def verifies(path: Path) -> bool:
    try:
        verify(path, shards=False)  # complete and sound; the shards' checksums are read only to resume
        return True
    except CheckpointError:
        return False
    except ConfigError:  # a newer plait's: sound as far as this one can tell, never to be deleted
        return True


def check_shapes(path: Path, model: torch.nn.Module) -> None:
    """Compare the checkpoint's model tensors with ``model`` (may live on meta). Raises CheckpointError."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from core.checkpoint.safe_dcp import load_metadata

    meta = load_metadata(path)
    saved = {k[len("model.") :]: tuple(v.size) for k, v in meta.state_dict_metadata.items() if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - set(want))
    mismatched = sorted(k for k in set(want) & set(saved) if want[k] != saved[k])
    if mismatched:
        details = ", ".join(f"{k} {saved[k]} vs model {want[k]}" for k in mismatched[:4])
        more = f" and {len(mismatched) - 4} more" if len(mismatched) > 4 else ""
        raise CheckpointError(f"checkpoint {path} does not fit the model: {details}{more}")
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks model keys: {', '.join(missing[:6])}")
    if extra:  # loading would drop them silently, and the next saves (then pruning) would lose them for good
        more = f" and {len(extra) - 6} more" if len(extra) > 6 else ""
        raise CheckpointError(f"checkpoint {path} holds model keys the model lacks (a larger model?): {', '.join(extra[:6])}{more}")


def check_fits(opts: CheckpointOptions, path: Path, model_meta: torch.nn.Module | None, architecture: dict[str, Any] | None = None) -> None:
    """A model that changed shape, or its architecture with every shape kept (``architecture``: the
    spec's declared options, :mod:`core.checkpoint.architecture`), is the user's mistake, not damage:
    an error, never a fallback (starting fresh would later prune the run's real checkpoints)."""
    from core.checkpoint.architecture import check_architecture

    if "model" in opts.exclude_from_loading:
        return
    if model_meta is not None:
        check_shapes(path, model_meta)
    check_architecture(path, architecture, explicit=opts.resume != "auto")


def warn(message: str) -> None:
    """A one-line warning, from rank 0 only."""
    if int(os.environ.get("RANK", 0)) == 0:
        log.warn(f"{message}")


def being_set_aside(root: Path) -> set[str]:
    """Checkpoint folders a start that was killed while moving a left branch aside had not moved
    yet (``SETTING_ASIDE.json``, :mod:`core.checkpoint.retention`): never resumed from; the next start moves them."""
    try:
        return set(read_small_json(root / SETTING_ASIDE_FILE))
    except (OSError, ValueError, TypeError):
        return set()


def refuse_restart_in_place(opts: CheckpointOptions, root: Path, path: Path, done: list[Path]) -> None:
    """Excluding ``train`` starts the step count and the run's lineage over. In a checkpoint folder
    that already holds checkpoints its saves would collide with them (each one skipped, the final
    one included), and a restart of the same command would start over once more. ``done``: the
    committed checkpoints in ``root``. Raises CheckpointError."""
    if "train" not in opts.exclude_from_loading or not done:
        return
    if path.parent.resolve() == root.resolve():
        why = f"in the folder of the checkpoints its saves would collide with ({root})"
    else:
        why = f"but {root} already holds checkpoints (a restart of this command?); to go on with them, resume without 'train' excluded"
    raise CheckpointError(
        f"checkpoint.exclude_from_loading has 'train': the run would start over at step 0 from {path}, {why}; a run that "
        f'starts over needs an empty checkpoint folder (--train.output_dir=... with checkpoint.resume = "{path}"), or '
        "start from the weights with checkpoint.initial_load"
    )


def find_resume(opts: CheckpointOptions, root: Path, model_meta: torch.nn.Module | None, architecture: dict[str, Any] | None = None) -> list[Path]:
    """The checkpoints to try resuming from, best first, checked before any process group exists.

    An explicit path must pass :func:`verify` without the shard checksums, and
    fit the model (its ``architecture`` and shapes), or it is an error. ``resume = "auto"``: the newest complete
    checkpoint that passes the same checks, then every older one (checked
    later, should the first fail the checks made after the process group
    exists, :mod:`core.checkpoint.resume`); each damaged one is skipped with a warning. Where the
    folder records the run that last trained into it (``CURRENT_RUN``), only that run's checkpoints
    are candidates: another run's beside them (``allow_foreign``) are never continued by a restart.
    """
    refuse_foreign(opts, root)
    if opts.resume == "none":
        return []
    if opts.resume != "auto":
        path = Path(opts.resume)
        verify(path, shards=False)
        check_fits(opts, path, model_meta, architecture)
        refuse_restart_in_place(opts, root, path, committed(root))
        return [path]
    aside, every = being_set_aside(root), committed(root)
    if (current := current_run(root)) is not None:
        others = [p for p in every if lineage_of(p) != current]
        every = [p for p in every if lineage_of(p) == current]
        for p in others:  # damage (a flipped bit) in the file that says whose it is: not silently passed over
            if lineage_of(p) is None:
                unknown_owner(p)
        if others and not every:
            warn(
                f"{root} holds {len(others)} checkpoint(s) of other runs and none of the run that last trained there "
                f"({CURRENT_RUN_FILE}): starting fresh; to continue one of them, name it (--checkpoint.resume=<its folder>)"
            )
    done = [p for p in reversed(every) if p.name not in aside]
    unmarked_newer(root, done[0] if done else None, current)
    if aside & {p.name for p in every}:
        warn(f"a start was killed while moving {', '.join(sorted(aside))} aside (a branch left): not resuming from them")
    for i, path in enumerate(done):
        try:
            verify(path, shards=False)
        except CheckpointError as e:  # damaged: fall back to the one before
            warn(f"skipping checkpoint: {e}")
            continue
        check_fits(opts, path, model_meta, architecture)
        refuse_restart_in_place(opts, root, path, every)
        return done[i:]
    if done:
        warn(f"no usable checkpoint in {root}: starting fresh")
    return []


def unknown_owner(path: Path) -> None:
    """The warning for a checkpoint whose ``LINEAGE`` cannot be read as a run's id (none if it has none)."""
    try:
        if not (path / LINEAGE_FILE).exists():
            return
        why = "is damaged (not a run's id)"
    except OSError as e:
        why = f"is unreadable ({e.strerror or e})"
    warn(f"skipping checkpoint: {path / LINEAGE_FILE} {why}: whose checkpoint it is is unknown, so it is left as it is")


def unmarked_newer(root: Path, newest: Path | None, current: str | None) -> None:
    """One line for each step folder newer than ``newest`` (the newest committed candidate) that has
    no ``COMMITTED`` marker: an interrupted save, or a checkpoint whose marker was removed; either way
    it is not resumed from. Only the run's own (``current``) where the folder records one."""
    for p in reversed(step_dirs(root)):
        if newest is not None and p.name <= newest.name:
            break
        if marked(p) or (current is not None and lineage_of(p) != current):
            continue
        warn(f"skipping checkpoint {p}: no {COMMIT_MARKER} marker (a save that was interrupted, or its marker was removed)")


def read_json(file: Path) -> Any:
    try:
        return read_small_json(file)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is not readable JSON ({e})") from None


def plain(value: Any) -> Any:
    """JSON-ready: tensors (torchao keeps learning rates in tensors) become numbers."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value
