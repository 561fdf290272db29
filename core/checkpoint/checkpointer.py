"""Saving and loading the training state through ``torch.distributed.checkpoint`` (DCP).

:class:`Checkpointer` is built from the states it saves (:class:`TrainingState`): the model and
optimizer go to DCP shards, the schedule, data position and run counters to ``state.json``, the
RNGs to ``rng/``. It decides nothing about *when* to save (:mod:`core.loop.stop_policy` does); it
decides *how*: one save in flight, every rank agreeing on failure, never from NaN/inf state,
committed with checksums, then pruned by :mod:`core.checkpoint.retention` (only this run's own
verified checkpoints; never the lowest-loss one). The folder layout and verification are in
:mod:`core.checkpoint.folders`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from core.checkpoint import resume, retention
from core.checkpoint.async_save import AsyncSaves
from core.checkpoint.checkpoint_dir import CheckpointDir
from core.checkpoint.commit import StepFolders
from core.checkpoint.folders import CURRENT_RUN_FILE, SETTING_ASIDE_FILE, STATE_FILE, current_run, io_error, read_json, step_dir
from core.checkpoint.loading import Restorer
from core.checkpoint.rng import rng_state
from core.checkpoint.room import make_room
from core.checkpoint.save_contents import SaveContents
from core.checkpoint.save_points import SavePoints, observed
from core.checkpoint.training_state import TrainingState
from core.contract import log
from core.contract.errors import CheckpointError
from core.contract.protocols import loader_state_per_rank
from core.runtime import ownership, watchdog
from core.runtime.durable_io import replace_durable, write_durable

__all__ = ["CheckpointDir", "Checkpointer", "TrainingState"]


class Checkpointer:
    """Saves ``state`` into ``where`` and restores it from there; one per process.

    ``about``: facts written into state.json beside the state (``optimizer_plugin``, ``config``,
    ``versions``, ``seed``, ...); ``on_saved(step, path)`` is called once a save is committed;
    ``points``: the save's named points (:mod:`core.checkpoint.save_points`; by default those of
    the observers installed in this process).

    Its collaborators, each built from what it needs, are public and replaceable:

    - ``contents`` (:class:`core.checkpoint.save_contents.SaveContents`): what a save writes and the
      checks it passes first (``run.state`` is JSON, no NaN or inf);
    - ``folders`` (:class:`core.checkpoint.commit.StepFolders`): a save's step folder claimed,
      committed, or removed when any rank failed;
    - ``async_saves`` (:class:`core.checkpoint.async_save.AsyncSaves`): the host copy of an async
      save, the save in flight, the fallback to sync saves;
    - ``restorer`` (:class:`core.checkpoint.loading.Restorer`): a checkpoint loaded into the state;
    - ``retention`` (:class:`core.checkpoint.retention.Retention`) and ``losses``
      (:class:`core.checkpoint.retention.LossTally`, the ``train_loss`` of the next save).
    """

    def __init__(
        self,
        where: CheckpointDir,
        state: TrainingState,
        about: dict[str, Any],
        on_saved: Callable[[int, str], None] = lambda step, path: None,
        points: SavePoints | None = None,
    ) -> None:
        self.where, self.state, self.about, self.on_saved = where, state, about, on_saved
        self.opts, self.root, self.dist, self.group = where.opts, where.root, where.dist, where.group
        self.points = observed() if points is None else points
        self.losses = retention.LossTally(where.dist.device, self.group, measure_group=getattr(where.control, "group", None))
        self.retention = retention.Retention(self.root, self.opts, self.losses)
        self.contents = SaveContents(where, state, about)
        self.folders = StepFolders(where, self.retention, self.points)
        self.async_saves = AsyncSaves(where, self.contents)
        self.restorer = Restorer(where, state, about)
        self.last_saved_step = -1
        self.best_step = -1
        self.last_stall_s = 0.0  # how long the last save held the training loop (its copy included)

    @property
    def lineage(self) -> str:
        """This run's id: made at a fresh start, carried through every resume (``run.state``)."""
        return self.state.lineage

    def record_current_run(self) -> None:
        """Rank 0 writes this run's lineage to ``<dir>/CURRENT_RUN`` before its first step, so that a
        restart with ``resume = "auto"`` continues this run, not another run's checkpoints beside it."""
        if not self.dist.is_main:
            return
        try:
            if current_run(self.root) != self.lineage:
                self.root.mkdir(parents=True, exist_ok=True)
                replace_durable(self.root / CURRENT_RUN_FILE, self.lineage + "\n")
        except OSError as e:
            log.warn(f"could not record this run in {self.root / CURRENT_RUN_FILE} ({e}); a restart may resume another run's newest checkpoint there")
        try:
            retention.settle_set_aside(self.root)
        except OSError as e:
            log.warn(f"could not update {self.root / SETTING_ASIDE_FILE} ({e}); a restart may skip checkpoints it names")

    # ---- save ----
    def maybe_save(self, step: int, use_async: bool | None = None) -> None:
        """Save at ``step`` unless it was already saved."""
        if step == self.last_saved_step:
            return
        self.save(step, use_async=self.opts.async_save if use_async is None else use_async)

    def save(self, step: int, use_async: bool) -> None:
        """Save the state as the checkpoint of ``step``: after the save in flight is committed, check
        it, claim its folder, write every rank's files, and commit (sync) or leave it in flight
        (async; :meth:`poll` and :meth:`wait` commit it). Any rank's failure raises SaveFailed on all."""
        import torch.distributed.checkpoint as dcp

        from core.checkpoint.safe_dcp import HashingFileSystemWriter

        self.wait()  # one save in flight at a time
        self.folders.begin()
        watchdog.progress(f"saving the checkpoint of step {step} (checking and claiming it)")
        self.contents.check_run_state()
        started = time.perf_counter()
        use_async = self.async_saves.possible() if use_async else False
        state = self.contents.dcp_state()
        self.points.started(step)
        self.contents.check_finite(step, state)
        state = self.contents.written_share(state)
        path = step_dir(self.root, step)
        error: BaseException | None = None
        claimed, in_use = 1, None  # claimed: 1 ready, 0 skipped, -1 a folder of the run is another job's now
        self.losses.measure()  # before make_room: a sound measurement of the newest releases the older ones (retention.held)
        try:
            if self.dist.is_main:
                ownership.hold_run_folders()  # a run folder deleted or moved aside mid-run is locked again, or another job's
                make_room(self.root, self.retention, self.lineage, step)  # what the prune after it would remove, early
                claimed = int(self.folders.claim(path, self.lineage))
                self.points.claimed(step, path)
        except ownership.FolderInUse as e:
            claimed, in_use = -1, str(e)
        except OSError as e:
            error = e
        self.folders.fail_together(error, step, path, self.lineage)
        claimed = self.where.agree(claimed)
        if claimed < 0:  # one line from rank 0, exit code 2 (launchers never restart it); that job keeps the folder
            resume.stop_every_rank(self.where, in_use or "")
        if not claimed:
            return
        try:
            write_durable(path / "rng" / f"rank_{self.dist.rank}.json", json.dumps(rng_state()))
            if loader_state_per_rank(self.state.loader):  # streaming sources: each rank's own position
                write_durable(path / "rng" / f"data_rank_{self.dist.rank}.json", json.dumps(self.state.loader.state_dict()))
        except OSError as e:
            error = e
        self.folders.fail_together(error, step, path, self.lineage)  # no rank enters DCP's collectives unless every rank got this far
        json_state = self.contents.json_state(self.losses.mean_and_reset(), self.losses.weights_loss_and_reset(self.root, step))
        writer = HashingFileSystemWriter(path)  # each block it writes is progress of the phase that waits for it (core.runtime.watchdog)
        watchdog.progress(f"saving the checkpoint of step {step} (writing its files)", waits=True)  # its blocks count, from whichever thread DCP writes them
        try:
            if use_async:
                self.async_saves.start(state, writer, step, path, json_state)
                self.last_stall_s = time.perf_counter() - started
            else:
                dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
                self.last_stall_s = time.perf_counter() - started
                self.commit(step, path, json_state, writer.checksums)
        except BaseException as e:  # DCP wraps each rank's error in a CheckpointException (a BaseException)
            error = io_error(e)
            if error is None:
                raise
        self.folders.fail_together(error, step, path, self.lineage)
        self.last_saved_step = step
        if self.dist.is_main:
            kind = "async" if use_async else "sync"
            log.info(f"checkpoint step {step}: {kind} save stalled training {self.last_stall_s:.3f} s")

    def commit(self, step: int, path: Path, json_state: dict[str, Any], checksums: dict[str, str]) -> None:
        """Commit the written save of ``step`` (rank 0 writes; every rank calls it), prune, and tell ``on_saved``."""
        self.points.before_commit(step, path)
        best = self.state.run.state.get("best_checkpoints", []) if step == self.best_step else None
        in_flight = self.async_saves.pending.path if self.async_saves.pending is not None else None
        self.folders.commit(step, path, json_state, checksums, self.lineage, best, in_flight)
        self.on_saved(step, str(path))
        self.points.after_commit(step, path)

    # ---- async saves ----
    def before_update(self) -> None:
        """Called before each optimizer step: wait for an async save's copy of the state; and once the
        optimizer state exists, have the host buffers of async saves allocated in the background."""
        self.wait_for_staging()
        if self.opts.async_save:
            self.async_saves.prepare(self.state.optimizer)

    def wait_for_staging(self) -> None:
        """Block until an async save's copy of the state is made. Called before anything changes the
        state (the optimizer step, a load); the wait counts in ``last_stall_s``."""
        self.last_stall_s += self.async_saves.wait_for_copy(self.last_saved_step)

    def poll(self) -> None:
        """Called at step boundaries (never blocks): once a step measured the newest checkpoint's
        weights, every rank agrees on that loss and rank 0 prunes what the checkpoint was holding
        (:func:`core.checkpoint.retention.held`); and a finished async save is committed: every rank
        commits it, or agrees on its failure, at the same step."""
        measured = self.losses.measure()
        if measured is not None and self.dist.is_main and self.opts.keep_latest and step_dir(self.root, measured).is_dir():
            in_flight = self.async_saves.pending.path if self.async_saves.pending is not None else None
            self.retention.prune(self.lineage, in_flight)
        if self.async_saves.written_everywhere():
            self.wait()

    def finish(self, diverged: bool) -> None:
        """The run ends (after its last save is committed): unless it ``diverged``, the newest
        checkpoint, which no step of this run will measure, holds no older one (rank 0 prunes)."""
        if not diverged and self.dist.is_main and self.opts.keep_latest:
            self.retention.prune(self.lineage, None, final=True)

    def wait(self) -> None:
        """Block until the save in flight is written, then commit it."""
        if (pending := self.async_saves.take()) is None:
            return
        self.wait_for_staging()
        future, step, path, json_state, writer = pending
        watchdog.progress(f"waiting for the async save of step {step} to be written", waits=True)  # its writer's blocks are progress
        error = None
        try:
            future.result()
            self.commit(step, path, json_state, writer.checksums)
        except BaseException as e:
            error = io_error(e)
            if error is None:
                raise
        self.folders.fail_together(error, step, path, self.lineage)

    def save_best(self, step: int) -> None:
        """A value of ``best_metric`` at ``step`` entered the top ``keep_best`` (``run.state["best_checkpoints"]``,
        the same on every rank): save this step (its commit rewrites BEST.json), or, if it is
        already committed, just rewrite BEST.json."""
        self.best_step = step
        if step != self.last_saved_step:
            self.maybe_save(step)
        elif self.async_saves.pending is None and self.dist.is_main:
            retention.write_best(self.root, self.state.run.state.get("best_checkpoints", []), self.opts.best_metric, self.opts.best_mode)

    # ---- rollback and load ----
    def rollback_target(self) -> Path | None:
        """This run's newest checkpoint that every rank finds sound, its shards' checksums included
        (each rank a share, :func:`core.checkpoint.resume.check_here`), or None; a damaged one is
        skipped with a warning. The save in flight is committed first (its commit prunes; listing
        before it could name a checkpoint that pruning then deletes)."""
        self.wait()
        for path in reversed(self.where.own(self.lineage)):
            watchdog.progress(f"checking the checkpoint {path.name} for a rollback")
            error = None
            try:
                resume.check_here(self, path)
            except Exception as e:  # noqa: BLE001 - every rank must reach agree(), whatever went wrong here
                error = str(e) if isinstance(e, CheckpointError) else resume.one_line(path, "could not be checked", e)
            error = resume.agree(self.group, error)
            if error is None:
                return path
            log.warn(f"rollback: skipping {path.name}: {error}")
        return None

    def roll_back(self) -> bool:
        """Restore the last complete checkpoint (:meth:`rollback_target`) but keep the data position,
        so that the data since then is skipped; the run's wall time keeps counting (budgets). False
        if there is none (the caller skips the update instead)."""
        if (target := self.rollback_target()) is None:
            log.info("rollback asked, but there is no sound checkpoint: skipping the update instead")
            return False
        position, wall = self.state.loader.state_dict(), self.state.run.state.get("wall_time_s", 0.0)
        self.state.optimizer.zero_grad(set_to_none=True)
        self.load(target, exclude=frozenset({"data"}))
        self.state.loader.load_state_dict(position)
        self.state.run.state["wall_time_s"] = wall
        log.info(f"rolled back to {target.name}; the data since then is skipped")
        return True

    def load(self, path: Path, exclude: frozenset[str] = frozenset()) -> None:
        """Restore the state from ``path``, leaving out ``checkpoint.exclude_from_loading`` and ``exclude``.
        May fail half-way, leaving the state mixed: the caller builds it afresh then."""
        self.wait_for_staging()  # an async save may still be copying the state this load overwrites
        self.restorer.load(path, set(self.opts.exclude_from_loading) | set(exclude))
        self.last_saved_step = self.state.run.step
        self.losses.resumed(read_json(path / STATE_FILE))  # the next step measures the loaded weights
