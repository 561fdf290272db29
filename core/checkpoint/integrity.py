"""What a checkpoint's ``COMMITTED`` manifest promises, and checking it.

The manifest lists every file of the checkpoint folder with its size
(``files``) and its CRC-32 (``checksums``, with ``"checksum": "crc32"``).
CRC-32 (zlib) is the fastest content checksum in the standard library here
(``bench/checkpoint_hash.py``); it guards against damage, not against an
attacker, who could rewrite the manifest too (that is what
:mod:`core.checkpoint.safe_dcp` is for). Checkpoints written before checksums existed
have sizes only; they are still accepted, with a warning.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.contract import log
from core.contract.errors import CheckpointError
from core.runtime import watchdog
from core.runtime.small_files import read_json

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


class Checksum:
    """A running CRC-32, fed while a file is written or read."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)
        watchdog.alive()  # a block written or checked: a long save or resume check that moves is no stall

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


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


def read_manifest(marker: Path) -> Manifest:
    try:
        data = read_json(marker)
        sizes = {str(k): size(v, k) for k, v in data["files"].items()}
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


def size(value: Any, name: Any) -> int:
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


def share(names: list[str], sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
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
