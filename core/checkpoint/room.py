"""Room on the disk for the next checkpoint, made before a save rather than found missing in it.

Pruning runs after a save commits, so a run that keeps ``keep_latest`` checkpoints needs room for
one more while it saves. When the disk has less than that (it was sized for ``keep_latest``, or
something else filled it), rank 0 removes, before the save, the oldest of this run's checkpoints
that the prune after that save would remove anyway, one at a time, until the new one fits. It never
removes the newest complete checkpoint, the lowest-loss one or the best ones, nor anything of
another run. When even that is not enough, the save goes ahead and a full disk stops the run as
before (exit 74, the last complete checkpoint kept).
"""

from __future__ import annotations

from pathlib import Path

from core.checkpoint import integrity
from core.checkpoint.folders import COMMIT_MARKER, committed_newest_first, lineage_of, step_dirs
from core.checkpoint.retention import Retention, own_verified, remove
from core.contract import log
from core.contract.errors import CheckpointError

MARGIN = 1.05  # a checkpoint can grow a little from one save to the next (the data state, the JSON parts)


def size_on_disk(path: Path) -> int:
    """The bytes a committed checkpoint's manifest lists."""
    return sum(integrity.read_manifest(path / COMMIT_MARKER).sizes.values())


def make_room(root: Path, retention: Retention, lineage: str, step: int) -> list[str]:
    """Before the save of ``step`` (rank 0, no save in flight): remove early what the next prune
    would remove, oldest first, while the disk lacks room for a checkpoint as large as the newest.
    The names removed, said in one warning line."""
    from core.runtime.disk import free_bytes, size_text

    newest = next((p for p in committed_newest_first(root) if lineage_of(p) == lineage), None)  # not every one's: keep_latest = 0 keeps many
    try:
        needed = int(size_on_disk(newest) * MARGIN) if newest is not None else 0
    except (OSError, ValueError, CheckpointError):
        return []
    free = free_bytes(root)
    if not needed or free is None or free >= needed:
        return []  # the common case: one statfs and one small read
    good = own_verified(root, lineage)
    if not good:
        return []
    newest = list(good)[-1]
    unfinished = [p for p in step_dirs(root) if p.name < newest.name and not (p / COMMIT_MARKER).exists() and lineage_of(p) == lineage]
    removed: list[str] = []
    for old in unfinished + retention.removed_by_next_prune(good):
        remove(old)
        removed.append(old.name)
        free = free_bytes(root) or 0
        if free >= needed:
            break
    if removed:
        enough = "" if free >= needed else f"; still short of room ({size_text(free)} free), the save may fail"
        log.warn(
            f"{root}: {size_text(free)} free after removing {', '.join(removed)} before the save of step {step} "
            f"(a checkpoint takes about {size_text(needed)}; pruning would have removed them after it){enough}"
        )
    return removed
