"""Saving, committing and restoring the training state through ``torch.distributed.checkpoint``.

:class:`Checkpointer` decides *how* to save, never *when* (:mod:`core.loop.stop_policy`): one save
in flight, every rank agreeing on failure, never from NaN/inf state, committed with checksums, then
pruned (:mod:`core.checkpoint.retention`); it restores, leaves a branch and rolls back.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from core.checkpoint import folders, replicas, resume, retention
from core.checkpoint.folders import (
    BEST_FILE,
    CHECKPOINT_FORMAT,
    COMMIT_MARKER,
    CURRENT_RUN_FILE,
    EXIT_SAVE_FAILED,
    LINEAGE_FILE,
    SETTING_ASIDE_FILE,
    STATE_FILE,
    NonFiniteState,
    SaveFailed,
    committed,
    count_nonfinite,
    current_run,
    io_error,
    lineage_of,
    plain,
    read_json,
    step_dir,
    verifies,
)
from core.checkpoint.resume import CheckpointDir, Restorer, TrainingState, rng_state
from core.checkpoint.retention import make_room
from core.contract import log
from core.contract.errors import EXIT_BAD_INPUT, CheckpointError, ConfigError, DataError, PluginError
from core.contract.protocols import loader_state_per_rank
from core.runtime import ownership, watchdog
from core.runtime.durable_io import replace_durable, sync_dir, write_durable

if TYPE_CHECKING:  # torch.distributed.checkpoint takes seconds to import: at the first save
    from core.checkpoint.safe_dcp import HashingFileSystemWriter
    from core.checkpoint.staging import HostStager


class Checkpointer:
    """Saves ``state`` into ``where`` and restores it from there; one per process. ``about``: facts
    written into state.json beside the state (``optimizer_plugin``, ``config``, ``versions``, ``seed``);
    ``on_saved(step, path)``: called once a save is committed; ``points``: the save's named points
    (:class:`SavePoints`; by default those of the observers installed in this process).

    Its parts: ``contents`` (:class:`SaveContents`: what a save writes, checked first), ``folders``
    (:class:`StepFolders`: claimed, committed, removed on failure), ``async_saves``
    (:class:`AsyncSaves`), ``restorer`` (:class:`core.checkpoint.resume.Restorer`), ``retention`` and
    ``losses`` (:mod:`core.checkpoint.retention`). Before any process group exists ``core.preflight``
    asks it for the checkpoints to resume (:meth:`find_resume`, :meth:`after_divergence`) and what the
    disk holds at once (:meth:`kept_at_once`, by the retention rule :meth:`retained`).
    """

    find_resume = staticmethod(resume.find_resume)
    after_divergence = staticmethod(retention.after_divergence)
    kept_at_once = staticmethod(retention.kept_at_once)
    retained = staticmethod(retention.retained)

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

        from core.checkpoint.safe_dcp import HashingFileSystemWriter  # torch.distributed.checkpoint takes seconds to import: at the first save

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
                resume.check_here(self.where, path)
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

    def restore(self, path: Path, last: bool) -> bool:
        """Load ``path``, a candidate every rank found sound (:meth:`CheckpointDir.first_sound`); False
        on every rank if it failed anywhere (the caller builds the state afresh before the next one,
        ``last``: there is none). A failure that is this run's config, not damage, stops every rank."""
        error, bad_input = None, False
        try:
            self.load(path)
        except (ConfigError, DataError) as e:  # this config cannot continue it: the user's to fix, not damage
            error, bad_input = str(e) if str(e).startswith(f"checkpoint {path}") else f"checkpoint {path}: {e}", True
        except CheckpointError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - whatever the trainer could not take
            error = resume.one_line(path, "could not be loaded", e)
        error = resume.agree(self.group, error, bad_input)
        if error is None:
            return True
        if isinstance(error, resume.BadInput):  # never a fallback: every older checkpoint of the run would fail alike
            resume.stop_every_rank(self.where, error)
        resume.drop(self.where, error, last)
        return False

    def leave_branch(self, path: Path, passed_over: str = "") -> None:
        """After resuming from ``path``: this run's later checkpoints are a branch it leaves; rank 0
        moves them aside (:func:`core.checkpoint.retention.set_aside_later`; ``passed_over``: why
        ``resume = "auto"`` went back past them). A failed move stops every rank."""
        error = None
        if self.dist.is_main:
            try:
                retention.set_aside_later(self.root, self.lineage, path, self.state.run.step, chosen=self.opts.resume != "auto", passed_over=passed_over)
            except OSError as e:
                error = f"resumed from {path}, but could not move this run's later checkpoints aside ({e}); move them out of {self.root} and start again"
        if (error := resume.agree(self.group, error)) is not None:
            resume.stop_every_rank(self.where, error)

    def set_aside_unusable(self) -> None:
        """A ``resume = "auto"`` start that resumed nothing although the run that last trained here
        (``CURRENT_RUN``; every run where none is recorded) left committed checkpoints, each skipped as
        damaged or unloadable: rank 0 moves them to ``abandoned/<utc>_unusable/`` before the first step,
        so the fresh start's saves of the same steps are not skipped as another run's. A failed move
        stops every rank."""
        error = None
        if self.dist.is_main and self.opts.resume == "auto":
            before = current_run(self.root)
            unusable = [p for p in committed(self.root) if before is None or lineage_of(p) == before]
            if unusable:
                try:
                    dest = retention.set_aside(self.root, unusable, "unusable")
                    log.note(
                        f"the {len(unusable)} checkpoint(s) that could not be resumed ({unusable[0].name} to {unusable[-1].name}) are moved to {dest}: this fresh start saves in their place"
                    )
                except OSError as e:
                    error = f"no checkpoint in {self.root} could be resumed, and moving them aside failed ({e}); move them out of {self.root} and start again"
        if (error := resume.agree(self.group, error)) is not None:
            resume.stop_every_rank(self.where, error)


class StepFolders:
    """The step folders of saves into ``where`` (one save at a time): ``retention`` prunes after each
    commit; ``points``: the save's named points this calls (:mod:`core.checkpoint.checkpointer`)."""

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
        never deleted, and so is a sound checkpoint of this run's (a branch left), and anything there
        that cannot be read as a checkpoint folder (:func:`core.checkpoint.folders.unreadable`)."""
        if os.path.lexists(path) and (why := folders.unreadable(path)):
            where = retention.set_aside_one(self.where.root, path, f"before_{path.name}")
            log.note(f"{path} {why}: plait cannot read or replace it as a checkpoint; moved to {where} (kept, never resumed from), this save takes its name")
        elif path.exists():
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
            if folders.marker_file(path):
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
        json_state = dict(json_state, tokenizer=folders.record_for(path, json_state.get("tokenizer")))  # findable when moved
        write_durable(path / STATE_FILE, json.dumps(json_state, indent=1))
        self.points.state_written(step, path)
        sync_dir(path / "rng")
        sync_dir(path)
        manifest = {"step": step, "world_size": self.where.dist.world_size, **folders.manifest_files(path, exclude=COMMIT_MARKER, known=checksums)}
        text = json.dumps(manifest, indent=1)
        self.points.writing_marker(step, path, text)
        replace_durable(path / COMMIT_MARKER, text)
        self.points.committed(step, path)
        sync_dir(root)  # the step folder's own name
        if best is not None:
            retention.write_best(root, best, self.where.opts.best_metric, self.where.opts.best_mode)
        watchdog.progress(f"pruning old checkpoints after the commit of step {step}")
        self.retention.prune(lineage, in_flight)


class SaveContents:
    """What a save of ``state`` writes on the ranks of ``where``: the DCP state (model and optimizer)
    and this rank's share of it, ``state.json``'s contents (``about``: the facts written beside the
    state: ``optimizer_plugin``, ``versions``, ``data_fingerprint``, ``architecture``, ``tokenizer``),
    and the checks a save passes first: ``run.state`` holds JSON values, no tensor holds NaN or inf."""

    def __init__(self, where: CheckpointDir, state: TrainingState, about: dict[str, Any]) -> None:
        self.where, self.state, self.about = where, state, about
        self.mixed_replicas_said = False  # the warning that the ranks' replicated tensors differ, given once

    def dcp_state(self) -> dict[str, Any]:
        """The model's and optimizer's state dicts, as DCP saves them (full, unsharded names). Under
        pipeline parallelism the optimizer's is flattened (a key per parameter's state and group
        setting): each stage holds other parameters, and DCP keeps one rank's copy of a nested
        ``param_groups``; a load reads either form (:mod:`core.checkpoint.resume`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        flat = StateDictOptions(flatten_optimizer_state_dict=self.where.dist.pp > 1)
        return {
            "model": get_model_state_dict(self.state.model),
            "optimizer": get_optimizer_state_dict(self.state.model, self.state.optimizer, options=flat),
        }

    def written_share(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's share of ``state`` (:mod:`core.checkpoint.replicas`): every DTensor shard it
        holds and the replicated tensors it writes, so that an async save copies only those. If
        the ranks do not see the same replicated tensors, each passes all of them and DCP picks."""
        if self.where.group is None or self.where.dist.pp > 1:  # pipeline stages hold different tensors: DCP picks
            return state
        mine = replicas.agreed_share(state, self.where.dist.rank, self.where.dist.world_size, self.where.agree)
        if mine is None:
            if not self.mixed_replicas_said:
                self.mixed_replicas_said = True
                log.warn("the ranks' replicated model/optimizer tensors differ in names, shapes or dtypes; every rank copies all of them for a save")
            return state
        return mine

    def json_state(self, train_loss: float | None, weights_loss: dict[str, float | None] | None = None) -> dict[str, Any]:
        """``state.json``'s contents; ``train_loss``: the mean over the steps since the previous save;
        ``weights_loss``: the loss measured on the weights of each earlier checkpoint on disk, by step
        (:func:`core.checkpoint.retention.weights_losses`)."""
        run, about = self.state.run, self.about
        sched = {k: plain(v) for k, v in self.state.scheduler.state_dict().items() if k != "lr_lambdas"}
        return {
            "format": CHECKPOINT_FORMAT,
            "step": run.step,
            "tokens_seen": run.tokens_seen,
            "train": dict(run.state),  # JSON values only (check_run_state)
            "lr_schedule": sched,
            "data": {} if loader_state_per_rank(self.state.loader) else self.state.loader.state_dict(),
            "optimizer_plugin": about["optimizer_plugin"],
            "world_size": self.where.dist.world_size,
            "config": run.config,
            "versions": about["versions"],
            "data_fingerprint": about.get("data_fingerprint"),
            "architecture": about.get("architecture"),  # resolved architecture values (core.checkpoint.folders)
            "tokenizer": about.get("tokenizer"),  # the data source's declared tokenizer (core.data.tokenizer_spec)
            "train_loss": train_loss,
            "weights_loss": weights_loss,
            "saved_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def check_run_state(self) -> None:
        """Rank 0's ``run.state`` (the one a checkpoint saves) must hold JSON values only: otherwise
        every rank stops, exit code 2, rank 0 naming the key, before anything of this save is written."""
        why = None
        for key, value in self.state.run.state.items() if self.where.dist.is_main else ():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                why = f"run.state[{key!r}] is not a JSON value ({e}); a monitor keeps only JSON values there (numbers, strings, lists, dicts): every checkpoint saves them"
                break
        if self.where.agree(int(why is not None), "sum"):
            if why is not None:
                raise PluginError(why)
            raise SystemExit(EXIT_BAD_INPUT)  # rank 0 says why, once

    def check_finite(self, step: int, state: dict[str, Any]) -> None:
        """Refuse to write NaN or inf: raise NonFiniteState (on every rank) if any shard holds one."""
        bad, total = count_nonfinite(state)
        bad, total = self.where.agree(bad, "sum"), self.where.agree(total, "sum")
        if bad:
            done = self.where.own(self.state.lineage)
            last = f"the last checkpoint, {done[-1]}, is kept" if done else "no checkpoint of this run exists yet"
            raise NonFiniteState(f"step {step}: {bad} of {total} model/optimizer tensors hold NaN or inf; not writing a checkpoint from them ({last})")


class PendingSave(NamedTuple):
    """An async save being written: its files are done when ``future`` is; ``writer`` then holds the shards' checksums."""

    future: Future
    step: int
    path: Path
    json_state: dict[str, Any]
    writer: HashingFileSystemWriter


class AsyncSaves:
    """The async saves of ``contents`` into ``where``: one in flight at a time (:attr:`pending`), its
    host copy made in the background (:attr:`copying`) into the buffers of :attr:`stager`, kept for
    the run (pinned on CUDA; ``None`` until the first async save or :meth:`prepare`)."""

    def __init__(self, where: CheckpointDir, contents: SaveContents) -> None:
        self.where, self.contents = where, contents
        self.stager: HostStager | None = None
        self.copying: Future | None = None  # the copy of the state of the save in flight, still being made
        self.pending: PendingSave | None = None
        self.sync_fallback = False  # async saves were asked for, but the host memory for their copy is short
        self.held_said = False  # the host memory of the copies, said once

    def host_stager(self) -> HostStager:
        """The run's :class:`core.checkpoint.staging.HostStager`, made at its first use."""
        if self.stager is None:
            from core.checkpoint.staging import HostStager

            self.stager = HostStager(self.where.dist.device)
        return self.stager

    def possible(self) -> bool:
        """False, on every rank, once any rank could not allocate the host buffers of async saves:
        the run goes on with sync saves (said once) rather than stop at its first save."""
        short = self.stager.out_of_memory() if self.stager is not None else ""
        if self.where.agree(int(not short), "min"):
            return True
        if not self.sync_fallback:
            self.sync_fallback = True
            why = short or "another rank had no host memory for its copy"
            log.warn(f"async saves need host memory for a copy of the state and {why}; saving synchronously from now on", all_ranks=bool(short))
        return False

    def prepare(self, optimizer: torch.optim.Optimizer) -> None:
        """Once ``optimizer``'s state exists, have the host buffers allocated in the background, so
        that the first save does not hold training while they are pinned (once per run)."""
        if self.stager is None and optimizer.state:
            self.host_stager().prepare(self.contents.written_share(self.contents.dcp_state()))

    def wait_for_copy(self, step: int) -> float:
        """Block until the copy of the state of the save in flight (of ``step``) is made; the
        seconds waited. A failed copy is left for the save's own future to report."""
        if self.copying is None:
            return 0.0
        dist = self.where.dist
        watchdog.progress(f"waiting for the async save's copy of the state (step {step})", waits=True)
        t0 = time.perf_counter()
        copying, self.copying = self.copying, None
        try:
            copying.result()
        except BaseException:  # noqa: BLE001 - the upload future fails with it; the wait for the save reports that
            pass
        else:
            if not self.held_said and dist.is_main and self.stager is not None:
                self.held_said = True
                pinned = ", pinned" if dist.device.type == "cuda" else ""
                log.info(f"async saves keep {self.stager.held_bytes() / 2**20:,.1f} MiB of host memory on rank 0 for their copy{pinned} (each rank its share)")
        waited = time.perf_counter() - t0
        if waited >= 0.1 and dist.is_main:
            log.info(f"checkpoint step {step}: training waited {waited:.3f} s more for the async save's copy of the state")
        return waited

    def start(self, state: dict[str, Any], writer: HashingFileSystemWriter, step: int, path: Path, json_state: dict[str, Any]) -> None:
        """Start writing ``state`` with ``writer`` (``dcp.async_save``); it is :attr:`pending` until taken."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        group = self.where.group
        response = dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=group is None, async_stager=self.host_stager())
        assert isinstance(response, AsyncSaveResponse), "a stager that returns a Future gets both futures back"
        self.copying = response.staging_completion
        self.pending = PendingSave(response.upload_completion, step, path, json_state, writer)

    def written_everywhere(self) -> bool:
        """Whether the save in flight is written on every rank (never blocks). While a save is in
        flight, one small all-reduce per call makes every rank answer the same at the same step."""
        if self.pending is None:
            return False
        not_done = int(not self.pending.future.done())
        if self.where.dist.world_size > 1:
            not_done = self.where.control.agree(not_done, "max")
        return not not_done

    def take(self) -> PendingSave | None:
        """The save in flight, which the caller now commits or fails; none is in flight after."""
        pending, self.pending = self.pending, None
        return pending


class SavePoints:
    """The named points of a save; each does nothing here. Subclass it and override the points you need."""

    def started(self, step: int) -> None:
        pass

    def claimed(self, step: int, path: Path) -> None:
        pass

    def before_commit(self, step: int, path: Path) -> None:
        pass

    def state_written(self, step: int, path: Path) -> None:
        pass

    def writing_marker(self, step: int, path: Path, text: str) -> None:
        pass

    def committed(self, step: int, path: Path) -> None:
        pass

    def after_commit(self, step: int, path: Path) -> None:
        pass


class ObservedPoints(SavePoints):
    """Each point of every observer in ``observers``, in the order they were installed."""

    def __init__(self, observers: list[SavePoints]) -> None:
        self.observers = observers

    def started(self, step: int) -> None:
        for o in self.observers:
            o.started(step)

    def claimed(self, step: int, path: Path) -> None:
        for o in self.observers:
            o.claimed(step, path)

    def before_commit(self, step: int, path: Path) -> None:
        for o in self.observers:
            o.before_commit(step, path)

    def state_written(self, step: int, path: Path) -> None:
        for o in self.observers:
            o.state_written(step, path)

    def writing_marker(self, step: int, path: Path, text: str) -> None:
        for o in self.observers:
            o.writing_marker(step, path, text)

    def committed(self, step: int, path: Path) -> None:
        for o in self.observers:
            o.committed(step, path)

    def after_commit(self, step: int, path: Path) -> None:
        for o in self.observers:
            o.after_commit(step, path)


_observers: list[SavePoints] = []


def observe(points: SavePoints) -> None:
    """Have every Checkpointer made from now on in this process call ``points`` too."""
    _observers.append(points)


def observed() -> SavePoints:
    """The points a new Checkpointer calls by default: those of every observer installed so far."""
    return ObservedPoints(list(_observers))
