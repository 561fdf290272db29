"""A save's step folder: :class:`StepFolders` claims it before anything is written (never another
run's checkpoint), commits it once every rank's files are on disk (``state.json``, checksums, the
``COMMITTED`` marker, then pruning), and, when any rank failed, removes what this save wrote, with
every rank raising :class:`core.checkpoint.folders.SaveFailed` together."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.checkpoint import integrity, retention, tokenizer_copy
from core.checkpoint.checkpoint_dir import CheckpointDir
from core.checkpoint.folders import BEST_FILE, COMMIT_MARKER, EXIT_SAVE_FAILED, LINEAGE_FILE, STATE_FILE, SaveFailed, committed, lineage_of, verifies
from core.checkpoint.save_points import SavePoints
from core.contract import log
from core.runtime import ownership, watchdog
from core.runtime.durable_io import replace_durable, sync_dir, write_durable


class StepFolders:
    """The step folders of saves into ``where`` (one save at a time): ``retention`` prunes after each
    commit; ``points``: the save's named points this calls (:mod:`core.checkpoint.save_points`)."""

    def __init__(self, where: CheckpointDir, retention: retention.Retention, points: SavePoints) -> None:
        self.where, self.retention, self.points = where, retention, points
        self.made: Path | None = None  # the step folder the save in hand made (rank 0), which its failure may remove

    def begin(self) -> None:
        """A new save: no folder of it made yet."""
        self.made = None

    def claim(self, path: Path, lineage: str) -> bool:
        """Make ``path`` ready for a save of run ``lineage`` (rank 0). Leftovers of this run's interrupted
        or damaged save of the same step are replaced. Another run's committed checkpoint is never
        touched (False: the save is skipped). An uncommitted folder of another run (or of none) is a
        save whose writer is dead (this job holds the folder's lock): it is moved to ``abandoned/``,
        never deleted, and so is a sound checkpoint of this run's (a branch left)."""
        if path.exists():
            ours, done = lineage_of(path) == lineage, (path / COMMIT_MARKER).is_file()
            if done and not ours:
                log.warn(f"{path} belongs to another run; not overwriting it, this save is skipped")
                return False
            what = "a checkpoint of this run's from another branch" if ours else "an interrupted save of another run"
            if ours and not (done and verifies(path)):
                retention.remove(path)  # what a save wrote; anything else stays, and is set aside below
                what = "files no save wrote"
            if path.exists():
                dest = retention.set_aside(self.where.root, [path], f"before_{path.name}")
                log.note(f"{path.name} held {what}; moved to {dest} (kept, never resumed from automatically)")
        (path / "rng").mkdir(parents=True)
        self.made = path  # this save's own folder: a failure removes what it wrote there, and only then
        write_durable(path / LINEAGE_FILE, lineage + "\n")
        return True

    def fail_together(self, error: BaseException | None, step: int, path: Path, lineage: str) -> None:
        """Every rank learns whether any rank failed to write this save. If one did, rank 0
        removes what this save wrote (its own step folder, never an older checkpoint) unless
        it was already committed, and every rank raises :class:`SaveFailed`."""
        dist, control = self.where.dist, self.where.control
        mine = f"{type(error).__name__}: {error}" if error is not None else ""
        if isinstance(error, RuntimeError):
            mine = f"torch's file writer failed, disk full? ({str(error).splitlines()[0]})"
        if dist.world_size > 1:
            if not control.agree(int(error is not None), "max"):
                return
            errors: list[str] = control.agree(mine, "all")
        elif error is None:
            return
        else:
            errors = [mine]
        rank = next(r for r, m in enumerate(errors) if m)
        kept = ""
        if dist.is_main:
            if (path / COMMIT_MARKER).is_file():
                kept = f"; {path.name} was committed before the error and is kept"
            elif self.made == path and lineage_of(path) in (None, lineage):  # made by this save (None: its LINEAGE write failed)
                retention.remove(path)  # what a save writes; a folder that was there before the claim is never touched
            (self.where.root / (BEST_FILE + ".tmp")).unlink(missing_ok=True)
        done = [p.name for p in committed(self.where.root)]
        last = f"the last complete checkpoint is {done[-1]}" if done else "there is no complete checkpoint"
        raise SaveFailed(f"checkpoint save at step {step} failed on rank {rank}: {errors[rank]}{kept}; {last}; stopping (exit code {EXIT_SAVE_FAILED})", step)

    def commit(
        self, step: int, path: Path, json_state: dict[str, Any], checksums: dict[str, str], lineage: str, best: list[Any] | None, in_flight: Path | None
    ) -> None:
        """Commit the written save of ``step`` (rank 0; the other ranks do nothing): ``state.json``, the
        ``COMMITTED`` manifest (``checksums``: the shards' CRC-32s from their writer), ``BEST.json`` when
        ``best`` is given, then pruning (never ``in_flight``, a save still being written).

        DCP's save returns (or its future resolves) on rank 0 only after every rank reported its
        writes (each fsynced), so rank 0 alone can commit. The marker reaches the disk after
        everything it lists, and is on disk before any older checkpoint is pruned
        (:mod:`core.runtime.durable_io`: a machine crash, not only a killed process)."""
        watchdog.progress(f"committing the checkpoint of step {step}")
        if not self.where.dist.is_main:
            return
        root = self.where.root
        ownership.fence()  # a run folder another job took while this one was stopped: no commit there, exit 2 at once
        json_state = dict(json_state, tokenizer=tokenizer_copy.record_for(path, json_state.get("tokenizer")))  # findable when moved
        write_durable(path / STATE_FILE, json.dumps(json_state, indent=1))
        self.points.state_written(step, path)
        sync_dir(path / "rng")
        sync_dir(path)
        manifest = {"step": step, "world_size": self.where.dist.world_size, **integrity.manifest_files(path, exclude=COMMIT_MARKER, known=checksums)}
        text = json.dumps(manifest, indent=1)
        self.points.writing_marker(step, path, text)
        replace_durable(path / COMMIT_MARKER, text)
        self.points.committed(step, path)
        sync_dir(root)  # the step folder's own name
        if best is not None:
            retention.write_best(root, best, self.where.opts.best_metric, self.where.opts.best_mode)
        watchdog.progress(f"pruning old checkpoints after the commit of step {step}")
        self.retention.prune(lineage, in_flight)
