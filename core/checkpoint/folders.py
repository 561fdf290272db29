"""A checkpoint folder: its layout, its commit manifest and verification, the model it fits.

``<dir>/step_000001000/`` holds every rank's DCP shards of ``{"model", "optimizer"}`` (resharded on
load: N ranks to M, ddp or fsdp2), ``state.json`` (step, tokens, schedule, global data position,
optimizer plugin, resolved config, versions), ``rng/rank_<r>.json``, ``LINEAGE`` (the run's id) and,
written last by rank 0, ``COMMITTED``: every file with its size and CRC-32 (a checksum finds damage;
:mod:`core.checkpoint.safe_dcp` reads the files without running code from them). A folder without
it, or whose files do not match it, is never resumed from. Nothing here needs a process group.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from core.config.sections import CheckpointOptions
from core.contract import log
from core.contract.errors import CheckpointError, ConfigError, PluginError
from core.contract.members import member
from core.runtime.durable_io import Checksum
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


def unreadable(path: Path) -> str:
    """Why ``path``, an entry named as a checkpoint folder, cannot be read as one: it is not a folder
    (a file, a link to nothing), or it cannot be listed or looked into (no read permission, as NFS
    with root squash or another owner leaves it); '' when it can."""
    if not os.path.isdir(path):
        return "is a link to nothing" if os.path.islink(path) else "is not a folder"
    try:
        names = os.listdir(path)
        for name in (COMMIT_MARKER, LINEAGE_FILE):
            if name in names:
                os.stat(path / name)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return ""


def marker_file(path: Path) -> bool:
    """Whether checkpoint folder ``path`` holds its commit marker as a file; False when that cannot be
    looked at (a save that failed on such a folder keeps it, untouched)."""
    try:
        return stat.S_ISREG(os.stat(path / COMMIT_MARKER).st_mode)
    except OSError:
        return False


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


def read_manifest(path: Path) -> Manifest:
    """The commit manifest of checkpoint folder ``path``. Raises CheckpointError."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    marker = path / COMMIT_MARKER
    if not marked(path):
        raise CheckpointError(folder_of_checkpoints(path) or f"checkpoint {path} is incomplete: no {COMMIT_MARKER} marker (interrupted save?)")
    return parse_manifest(marker)


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
    from core.checkpoint.safe_dcp import load_metadata  # torch.distributed.checkpoint takes seconds to import: only once one is read

    refuse_newer_format(path)
    manifest = read_manifest(path)
    check_sizes(path, manifest, exclude=COMMIT_MARKER)
    check_checksums(path, manifest, manifest.small_files() + (manifest.shards() if shards else []))
    load_metadata(path)
    try:
        state = read_small_json(path / STATE_FILE)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is corrupt ({e})") from None
    check_state(state, path / STATE_FILE)
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

    from core.checkpoint.safe_dcp import load_metadata  # as in _verify

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
    spec's declared options, :mod:`core.checkpoint.folders`), is the user's mistake, not damage:
    an error, never a fallback (starting fresh would later prune the run's real checkpoints)."""
    if "model" in opts.exclude_from_loading:
        return
    try:
        if model_meta is not None:
            check_shapes(path, model_meta)
    except CheckpointError as shapes:  # a changed architecture option is the cause to name first (qk_norm adds keys)
        try:
            check_architecture(path, architecture, explicit=opts.resume != "auto")
        except ConfigError as changed:
            raise ConfigError(f"{changed} ({shapes})") from None
        raise
    check_architecture(path, architecture, explicit=opts.resume != "auto")


def warn(message: str) -> None:
    """A one-line warning, from rank 0 only."""
    if int(os.environ.get("RANK", 0)) == 0:
        log.warn(f"{message}")


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


ALGORITHM = "crc32"
CHUNK_BYTES = 8 * 2**20
SHARD_SUFFIX = ".distcp"
# state.json keys that resuming, exporting and reporting read, and their types.
STATE_KEYS: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "tokens_seen": int,
    "train": dict,
    "lr_schedule": dict,
    "data": dict,
    "optimizer_plugin": str,
    "world_size": int,
    "config": dict,
}
_warned_size_only = False


def checksum_file(path: Path) -> str:
    """The file's checksum, read in chunks into one reused buffer."""
    checksum = Checksum()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            checksum.update(view[:n])
    return checksum.hexdigest()


def list_files(folder: Path, exclude: str) -> dict[str, int]:
    """Every file under ``folder`` but ``exclude`` (relative name -> size)."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file() and p.name != exclude}


def manifest_files(folder: Path, exclude: str, known: dict[str, str]) -> dict[str, Any]:
    """The manifest's file entries: sizes and checksums. ``known`` holds checksums computed
    while writing (the DCP shards); the other files (small: json, DCP metadata) are read."""
    sizes = list_files(folder, exclude)
    checksums = {name: known.get(name) or checksum_file(folder / name) for name in sizes}
    return {"files": sizes, "checksum": ALGORITHM, "checksums": checksums}


@dataclass
class Manifest:
    sizes: dict[str, int]
    checksums: dict[str, str] | None  # None: written before checksums existed

    def shards(self) -> list[str]:
        return [name for name in self.sizes if name.endswith(SHARD_SUFFIX)]

    def small_files(self) -> list[str]:
        return [name for name in self.sizes if not name.endswith(SHARD_SUFFIX)]


def parse_manifest(marker: Path) -> Manifest:
    try:
        data = read_small_json(marker)
        sizes = {str(k): listed_size(v, k) for k, v in data["files"].items()}
        checksums = data.get("checksums")
        if checksums is not None:
            if data.get("checksum") != ALGORITHM:
                raise ValueError(f"checksum {data.get('checksum')!r}, expected {ALGORITHM!r}")
            checksums = {str(k): str(v) for k, v in checksums.items()}
            if set(checksums) != set(sizes):
                raise ValueError("files and checksums list different files")
    except OSError as e:
        raise CheckpointError(f"{marker} is unreadable ({e.strerror or e})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{marker} is corrupt ({e})") from None
    return Manifest(sizes, checksums)


def listed_size(value: Any, name: Any) -> int:
    """A file size the manifest lists: a count of bytes (``int`` would take 1e400 for an overflow, 3.5 for 3)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"the size of {name!r} is {value!r}, expected a count of bytes")
    return value


def check_sizes(folder: Path, manifest: Manifest, exclude: str) -> None:
    actual = list_files(folder, exclude)
    for name, size in manifest.sizes.items():
        if name not in actual:
            raise CheckpointError(f"checkpoint {folder} is missing {name}")
        if actual[name] != size:
            raise CheckpointError(f"checkpoint {folder}: {name} is {actual[name]} bytes, expected {size} (truncated or corrupt)")


def check_checksums(folder: Path, manifest: Manifest, names: list[str]) -> None:
    """Compare the files ``names`` with their manifest checksums (nothing to do for old manifests)."""
    if manifest.checksums is None:
        warn_size_only(folder)
        return
    for name in names:
        actual = checksum_file(folder / name)
        if actual != manifest.checksums[name]:
            raise CheckpointError(
                f"checkpoint {folder}: {name} does not match its checksum ({ALGORITHM} {actual}, expected {manifest.checksums[name]}): corrupt"
            )


def warn_size_only(folder: Path) -> None:
    """Once per process, on rank 0."""
    global _warned_size_only
    if not _warned_size_only and int(os.environ.get("RANK", 0)) == 0:
        log.warn(f"checkpoint {folder} has no checksums (written by an older plait): only file sizes are checked")
    _warned_size_only = True


def checksum_share(names: list[str], sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The files of ``names`` that ``rank`` checks: largest first to the least loaded rank,
    the same split on every rank, so each byte is read once in all."""
    load = [0] * world_size
    mine = []
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        r = load.index(min(load))
        load[r] += sizes[name]
        if r == rank:
            mine.append(name)
    return mine


def check_state(state: Any, file: Path) -> None:
    """The keys (and their types) that resuming and exporting read from state.json."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    for key, kind in STATE_KEYS.items():
        if key not in state:
            raise CheckpointError(f"{file} lacks {key!r}")
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise CheckpointError(f"{file}: {key!r} is a {type(state[key]).__name__}, expected {getattr(kind, '__name__', kind)}")
    for key in ("step", "tokens_seen", "world_size"):
        if not 0 <= state[key] < 2**62 or (key == "world_size" and state[key] == 0):
            raise CheckpointError(f"{file}: {key!r} is {state[key]}, expected {'a positive' if key == 'world_size' else 'a non-negative'} count below 2**62")
    if (wrong := train_state_error(state["train"])) is not None:
        raise CheckpointError(f"{file}: 'train' {wrong}")


def train_state_error(train: dict[str, Any]) -> str | None:
    """What is wrong with the run's own entries of the train state (``run.state``), which the loop
    uses after a resume: a lineage that is not text, a wall time or best validation loss that is
    not a number, a ranking that is not ``[[loss, step], ...]``. Loaded as they were, each one ended
    the resumed run in a traceback at its first save or log line, on every restart, instead of a
    fall back to the checkpoint before. None when they are sound (monitors' entries are their own)."""

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)

    if "lineage" in train and not (isinstance(train["lineage"], str) and train["lineage"].strip()):
        return f"'lineage' is {train['lineage']!r}, expected the run's id"
    if "wall_time_s" in train and not (number(train["wall_time_s"]) and 0 <= train["wall_time_s"] < math.inf):
        return f"'wall_time_s' is {train['wall_time_s']!r}, expected a finite number of seconds >= 0"
    if "best_val_loss" in train and not number(train["best_val_loss"]):
        return f"'best_val_loss' is {train['best_val_loss']!r}, expected a number"
    ranking = train.get("best_checkpoints", [])
    if not isinstance(ranking, list) or not all(
        isinstance(e, list) and len(e) == 2 and number(e[0]) and isinstance(e[1], int) and not isinstance(e[1], bool) and e[1] >= 0 for e in ranking
    ):
        return f"'best_checkpoints' is {str(ranking)[:80]}, expected [[best_metric value (negated for best_mode = max), step], ...]"
    return None


RESOLVED = "(resolved)"  # the key of the resolved values: no option's name (an identifier) is it


def _plain_value(value: Any) -> Any:
    """As the value reads back from a checkpoint's state.json (tuples are lists there)."""
    return json.loads(json.dumps(value))


def run_architecture(spec: Any, name: str, section: dict[str, Any]) -> dict[str, Any] | None:
    """This run's model name and the values of its spec's ``architecture_options`` in ``section``
    (the resolved config's ``[model]``); None when the spec declares none. A declaration that is not
    a tuple of the names of its options is the plugin's error (PluginError)."""
    names = member("model", spec, "architecture_options")
    if names is None:
        return None
    where = f"model plugin {name!r}: architecture_options"
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise PluginError(f"{where} must be a tuple of option names, got {names!r}")
    options = [k for k in section if k != "name"]
    unknown = [n for n in names if n not in options]
    if unknown:
        raise PluginError(f"{where} names {unknown[0]!r}, which is not one of its [model] options ({', '.join(options)})")
    architecture = {"name": name, **{n: _plain_value(section[n]) for n in names}}
    resolved = member("model", spec, "resolved_architecture")
    if resolved is not None:
        architecture[RESOLVED] = _resolved(resolved(), f"model plugin {name!r}: resolved_architecture()")
    return architecture


def _resolved(values: Any, where: str) -> dict[str, Any]:
    """The spec's ``resolved_architecture()`` answer, held to ``{name: JSON value}``."""
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise PluginError(f"{where} returned {type(values).__name__}; expected {{name: value}} with string names")
    try:
        return _plain_value(values)
    except (TypeError, ValueError) as e:
        raise PluginError(f"{where} returned a value that is not JSON ({e}); expected numbers, strings, booleans or lists") from None


def differences(saved: dict[str, Any], expected: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(option, saved value, this run's)`` for each declared option that differs; another model
    name is the one difference (the options are another plugin's)."""
    if saved.get("name") != expected["name"]:
        return [("name", saved.get("name"), expected["name"])]
    old, new = saved.get(RESOLVED), expected.get(RESOLVED)
    if isinstance(old, dict) and new is not None:  # both resolved: the values the weights were built with
        return [(k, old[k], v) for k, v in new.items() if k in old and _plain_value(old[k]) != v]
    return [(k, saved[k], v) for k, v in expected.items() if k not in ("name", RESOLVED) and k in saved and _plain_value(saved[k]) != v]


def saved_model_section(path: Path) -> dict[str, Any] | None:
    """The ``[model]`` section of the config saved in checkpoint ``path``, with the resolved values its
    ``state.json`` recorded (``architecture``, key :data:`RESOLVED`) if any; None when it cannot be
    read (:func:`core.checkpoint.folders.verify` says what is wrong with such a checkpoint)."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        section = state["config"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(section, dict):
        return None
    recorded = state.get("architecture")
    if isinstance(recorded, dict) and recorded.get("name") == section.get("name") and isinstance(recorded.get(RESOLVED), dict):
        return {**section, RESOLVED: recorded[RESOLVED]}
    return section


def check_architecture(path: Path, expected: dict[str, Any] | None, explicit: bool, initial_load: bool = False) -> None:
    """Refuse checkpoint ``path`` (ConfigError, one line) when its model differs from ``expected``
    (:func:`run_architecture`) in name or a declared option. ``explicit``: named by
    ``checkpoint.resume``; ``initial_load``: the weights a fresh run starts from."""
    saved = saved_model_section(path) if expected is not None else None
    if saved is None or expected is None:
        return
    diff = differences(saved, expected)
    if not diff:
        return
    changes = ", ".join(f"model.{k} {old!r} -> {new!r}" for k, old, new in diff)
    them = "them" if len(diff) > 1 else "it"
    if initial_load:
        what, fix = f"checkpoint.initial_load {path}", f"change {them} back to start from its weights, or leave checkpoint.initial_load out"
    else:
        fresh = "a fresh run folder (another train.output_dir" + (", checkpoint.resume left out)" if explicit else ")")
        what, fix = f"checkpoint {path}", f"change {them} back to resume from it, or train the new architecture from scratch in {fresh}"
    raise ConfigError(f"{what} was saved with another model architecture: {changes}; its weights would compute another function in this model: {fix}")


COPY_LIMIT = 64 * 2**20
COPY_NAMES = {"hf": "tokenizer.json", "tiktoken": "tokenizer.tiktoken"}  # by kind; what pruning knows a save wrote


def record_for(checkpoint: Path, record: dict[str, Any] | None) -> dict[str, Any] | None:
    """``state.json``'s tokenizer record for the checkpoint folder ``checkpoint`` (rank 0, at its commit,
    before the manifest lists its files): ``relative`` added, and ``copy`` once the file is written there."""
    if not isinstance(record, dict) or not isinstance(record.get("fingerprint"), str):
        return record  # bytes (no file), or nothing declared
    kind, _, name = record["spec"].partition(":")
    file = Path(name)
    out = dict(record, relative=os.path.relpath(file, checkpoint.resolve()))
    try:
        if file.stat().st_size > COPY_LIMIT:
            log.warn(f"tokenizer {file} is over {COPY_LIMIT // 2**20} MiB: not copied into checkpoints (state.json records its path)", once="tokenizer-large")
            return out
        data = file.read_bytes()
    except OSError as e:
        log.warn(
            f"tokenizer {file}: not copied into the checkpoint ({type(e).__name__}: {e.strerror or e}); state.json records its path", once="tokenizer-gone"
        )
        return out
    if hashlib.sha256(data).hexdigest() != record["fingerprint"]:
        log.warn(
            f"tokenizer {file} changed since the run started (sha256): not copied into checkpoints; state.json records the first one's",
            once="tokenizer-changed",
        )
        return out
    with open(checkpoint / COPY_NAMES[kind], "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    out["copy"] = COPY_NAMES[kind]
    return out


class NonFiniteState(RuntimeError):
    """The parameters or optimizer state hold NaN or inf: no checkpoint is written from them."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _float_tensors(state: Any):
    if isinstance(state, torch.Tensor):
        t = _local(state)
        if type(t) is not torch.Tensor and hasattr(t, "dequantize"):  # low-bit optimizer states (torchao)
            t = t.dequantize()
        if t.is_floating_point():
            yield t
    elif isinstance(state, dict):
        for v in state.values():
            yield from _float_tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _float_tensors(v)


def count_nonfinite(state: Any) -> tuple[int, int]:
    """(tensors holding a NaN or inf, floating tensors) in a nested state dict; this rank's shards."""
    tensors = list(_float_tensors(state))
    if not tensors:
        return 0, 0
    flags = []
    for t in tensors:
        try:
            flags.append((~torch.isfinite(t)).any())
        except (NotImplementedError, RuntimeError):  # a tensor subclass without isfinite: not judged
            continue
    return (int(torch.stack(flags).sum()) if flags else 0), len(tensors)
