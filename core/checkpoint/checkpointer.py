"""Saving and loading the training state through ``torch.distributed.checkpoint`` (DCP).

:class:`Checkpointer` is built from the states it saves (:class:`TrainingState`):
the model and optimizer go to DCP shards, the schedule, data position and run
counters to ``state.json``, the RNGs to ``rng/``. It decides nothing about
*when* to save (:mod:`core.loop.stop_policy` does); it decides *how*: one save in
flight, every rank agreeing on failure, never from NaN/inf state, committed
with checksums, then pruned by :mod:`core.checkpoint.retention` (only this run's own
verified checkpoints; never the lowest-loss one). The folder layout and
verification are in :mod:`core.checkpoint.folders`.

It is the one object the trainer talks to; each of its jobs has a module of its own:
what a save writes and checks first (:mod:`core.checkpoint.save_contents`), a save's
folder claimed, committed or removed on failure (:mod:`core.checkpoint.commit`), the
async save's copy and polling (:mod:`core.checkpoint.async_save`), loading
(:mod:`core.checkpoint.loading`) and rollback (:mod:`core.checkpoint.rollback`); the
folder every rank sees is :class:`core.checkpoint.checkpoint_dir.CheckpointDir`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from core.checkpoint import async_save, commit, loading, retention, rollback, save_contents
from core.checkpoint.checkpoint_dir import CheckpointDir
from core.checkpoint.folders import CURRENT_RUN_FILE, SETTING_ASIDE_FILE, current_run, io_error, step_dir
from core.checkpoint.rng import rng_state
from core.checkpoint.room import make_room
from core.contract import log
from core.contract.protocols import loader_state_per_rank
from core.runtime import ownership, watchdog
from core.runtime.durable_io import replace_durable, write_durable

__all__ = ["CheckpointDir", "Checkpointer", "TrainingState"]


@dataclass
class TrainingState:
    """Everything a checkpoint holds, by part (``checkpoint.exclude_from_loading`` names them):
    ``model`` and ``optimizer`` (DCP shards), ``lr_schedule`` (``scheduler``), ``data``
    (``loader``'s position), ``train`` (``run``: step, tokens, ``run.state``) and ``rng``."""

    model: torch.nn.Module  # the unwrapped module: its state dict names are the checkpoint's
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: Any
    run: Any  # core.contract.run.Run


class Checkpointer:
    """Saves ``state`` into ``where`` and restores it from there; one per process.

    ``about``: facts written into state.json beside the state (``optimizer_plugin``,
    ``config``, ``versions``, ``seed``); ``on_saved(step, path)`` is called once a save is committed.
    """

    def __init__(
        self, where: CheckpointDir, state: TrainingState, about: dict[str, Any], on_saved: Callable[[int, str], None] = lambda step, path: None
    ) -> None:
        self.where, self.state, self.about, self.on_saved = where, state, about, on_saved
        self.opts, self.root, self.dist, self.group = where.opts, where.root, where.dist, where.group
        self.pending: tuple[Any, int, Path, dict[str, Any]] | None = None  # (future, step, path, state.json)
        self.last_saved_step = -1
        self.best_step = -1
        self.last_stall_s = 0.0  # how long the last save held the training loop (its copy included)
        self.staging: Any = None  # an async save's copy of the state, still being made (a Future)
        self._stager: Any = None  # one for the run: it keeps its (pinned, on CUDA) host buffers between saves
        self.sync_fallback = False  # async saves were asked for, but the host memory for their copy is short
        self.writer: Any = None  # the storage writer of the save in flight (its shard checksums)
        self.made: Path | None = None  # the step folder the save in hand made (rank 0), which its failure may remove
        self.mixed_replicas_said = False  # the warning that the ranks' replicated tensors differ, given once
        self.held_said = False  # the host memory of async saves' copies, said once
        self.retention = retention.Retention(self.root, self.opts)
        self.losses = retention.LossTally(where.dist.device, self.group)  # train_loss of the next save

    @property
    def lineage(self) -> str:
        """This run's id: made at a fresh start, carried through every resume (``run.state``)."""
        return self.state.run.state["lineage"]

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

    # A save's steps that tests/seams/sitecustomize.py (kill points, a paused or damaged commit) and tests
    # replace on the class: save() and async_save.wait() call them through the Checkpointer for that.
    def _check_finite(self, step: int, state: dict[str, Any]) -> None:
        """Refuse to write NaN or inf: raise NonFiniteState (on every rank) if any shard holds one."""
        save_contents.check_finite(self, step, state)

    def _claim(self, path: Path) -> bool:
        """Make ``path`` ready for this run's save (rank 0; :func:`core.checkpoint.commit.claim`)."""
        return commit.claim(self, path)

    def _dcp_state(self) -> dict[str, Any]:
        """The model's and optimizer's state dicts, as DCP saves them."""
        return save_contents.dcp_state(self)

    # ---- save ----
    def maybe_save(self, step: int, use_async: bool | None = None) -> None:
        """Save at ``step`` unless it was already saved."""
        if step == self.last_saved_step:
            return
        self.save(step, use_async=self.opts.async_save if use_async is None else use_async)

    def save(self, step: int, use_async: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        from core.checkpoint.safe_dcp import HashingFileSystemWriter

        self.wait()  # one save in flight at a time
        self.made = None
        watchdog.progress(f"saving the checkpoint of step {step} (checking and claiming it)")
        save_contents.check_run_state(self)
        started = time.perf_counter()
        use_async = async_save.async_possible(self) if use_async else False
        state = self._dcp_state()
        self._check_finite(step, state)
        state = save_contents.written_share(self, state)
        path = step_dir(self.root, step)
        error: BaseException | None = None
        claimed, in_use = 1, None  # claimed: 1 ready, 0 skipped, -1 a folder of the run is another job's now
        try:
            if self.dist.is_main:
                ownership.hold_run_folders()  # a run folder deleted or moved aside mid-run is locked again, or another job's
                make_room(self.root, self.retention, self.lineage, step)  # what the prune after it would remove, early
                claimed = int(self._claim(path))
        except ownership.FolderInUse as e:
            claimed, in_use = -1, str(e)
        except OSError as e:
            error = e
        commit.fail_together(self, error, step, path)
        claimed = self.where.agree(claimed)
        if claimed < 0:  # one line from rank 0, exit code 2 (launchers never restart it); that job keeps the folder
            from core.checkpoint.resume import stop_every_rank

            stop_every_rank(self.where, in_use or "")
        if not claimed:
            return
        try:
            write_durable(path / "rng" / f"rank_{self.dist.rank}.json", json.dumps(rng_state()))
            if loader_state_per_rank(self.state.loader):  # streaming sources: each rank's own position
                write_durable(path / "rng" / f"data_rank_{self.dist.rank}.json", json.dumps(self.state.loader.state_dict()))
        except OSError as e:
            error = e
        commit.fail_together(self, error, step, path)  # no rank enters DCP's collectives unless every rank got this far
        json_state = save_contents.json_state(self, self.losses.mean_and_reset())
        self.writer = HashingFileSystemWriter(path)  # each block it writes is progress of the phase that waits for it (core.runtime.watchdog)
        watchdog.progress(f"saving the checkpoint of step {step} (writing its files)", waits=True)  # its blocks count, from whichever thread DCP writes them
        try:
            if use_async:
                response = dcp.async_save(state, storage_writer=self.writer, process_group=self.group, no_dist=self.group is None, async_stager=self.stager())
                assert isinstance(response, AsyncSaveResponse), "a stager that returns a Future gets both futures back"
                self.staging, future = response.staging_completion, response.upload_completion
                self.last_stall_s = time.perf_counter() - started
                self.pending = (future, step, path, json_state)
            else:
                dcp.save(state, storage_writer=self.writer, process_group=self.group, no_dist=self.group is None)
                self.last_stall_s = time.perf_counter() - started
                self._commit(step, path, json_state)
        except BaseException as e:  # DCP wraps each rank's error in a CheckpointException (a BaseException)
            error = io_error(e)
            if error is None:
                raise
        commit.fail_together(self, error, step, path)
        self.last_saved_step = step
        if self.dist.is_main:
            kind = "async" if use_async else "sync"
            log.info(f"checkpoint step {step}: {kind} save stalled training {self.last_stall_s:.3f} s")

    def _commit(self, step: int, path: Path, json_state: dict[str, Any]) -> None:
        """Commit a written save (rank 0), then prune (:func:`core.checkpoint.commit.commit`)."""
        commit.commit(self, step, path, json_state)

    # ---- async saves (core.checkpoint.async_save) ----
    def stager(self) -> Any:
        """The run's :class:`core.checkpoint.staging.HostStager`, made at its first use."""
        return async_save.stager(self)

    def before_update(self) -> None:
        """Called before each optimizer step (:func:`core.checkpoint.async_save.before_update`)."""
        async_save.before_update(self)

    def wait_for_staging(self) -> None:
        """Block until an async save's copy of the state is made."""
        async_save.wait_for_staging(self)

    def poll(self) -> None:
        """Commit a finished async save (called at step boundaries; never blocks)."""
        async_save.poll(self)

    def wait(self) -> None:
        """Block until the save in flight is written, then commit it."""
        async_save.wait(self)

    def save_best(self, step: int) -> None:
        """A value of ``best_metric`` at ``step`` entered the top ``keep_best`` (``run.state["best_checkpoints"]``,
        the same on every rank): save this step (its commit rewrites BEST.json), or, if it is
        already committed, just rewrite BEST.json."""
        self.best_step = step
        if step != self.last_saved_step:
            self.maybe_save(step)
        elif self.pending is None and self.dist.is_main:
            retention.write_best(self.root, self.state.run.state.get("best_checkpoints", []), self.opts.best_metric, self.opts.best_mode)

    # ---- rollback and load (core.checkpoint.rollback, core.checkpoint.loading) ----
    def rollback_target(self) -> Path | None:
        """This run's newest checkpoint that every rank finds sound, or None."""
        return rollback.rollback_target(self)

    def roll_back(self) -> bool:
        """Restore the last complete checkpoint but keep the data position (False: there is none)."""
        return rollback.roll_back(self)

    def load(self, path: Path, exclude: frozenset[str] = frozenset()) -> None:
        """Restore the state from ``path``, leaving out ``checkpoint.exclude_from_loading`` and ``exclude``."""
        loading.load(self, path, exclude)
