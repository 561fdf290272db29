"""A rollback, for :class:`core.checkpoint.checkpointer.Checkpointer`: back to this run's newest
checkpoint that every rank finds sound, keeping the data position (the data since then is skipped)
and the run's wall time."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from core.contract import log
from core.contract.errors import CheckpointError
from core.runtime import watchdog

if TYPE_CHECKING:
    from core.checkpoint.checkpointer import Checkpointer


def rollback_target(ck: Checkpointer) -> Path | None:
    """The checkpoint a rollback restores: this run's newest that every rank finds sound, its
    shards' checksums included (each rank a share, :func:`core.checkpoint.resume.check_here`); a
    damaged one is skipped with a warning. The save in flight is committed first (its commit
    prunes; listing before it could name a checkpoint that pruning then deletes)."""
    from core.checkpoint import resume

    ck.wait()
    for path in reversed(ck.where.own(ck.lineage)):
        watchdog.progress(f"checking the checkpoint {path.name} for a rollback")
        error = None
        try:
            resume.check_here(ck, path)
        except Exception as e:  # noqa: BLE001 - every rank must reach agree(), whatever went wrong here
            error = str(e) if isinstance(e, CheckpointError) else resume.one_line(path, "could not be checked", e)
        error = resume.agree(ck.group, error)
        if error is None:
            return path
        log.warn(f"rollback: skipping {path.name}: {error}")
    return None


def roll_back(ck: Checkpointer) -> bool:
    """Restore the last complete checkpoint (:meth:`rollback_target`) but keep the data position,
    so that the data since then is skipped; the run's wall time keeps counting (budgets). False
    if there is none (the caller skips the update instead)."""
    if (target := ck.rollback_target()) is None:
        log.info("rollback asked, but there is no sound checkpoint: skipping the update instead")
        return False
    position, wall = ck.state.loader.state_dict(), ck.state.run.state.get("wall_time_s", 0.0)
    ck.state.optimizer.zero_grad(set_to_none=True)
    ck.load(target, exclude=frozenset({"data"}))
    ck.state.loader.load_state_dict(position)
    ck.state.run.state["wall_time_s"] = wall
    log.info(f"rolled back to {target.name}; the data since then is skipped")
    return True
