"""Saving and loading the training state through ``torch.distributed.checkpoint`` (DCP).

:class:`Checkpointer` is built from the states it saves (:class:`TrainingState`):
the model and optimizer go to DCP shards, the schedule, data position and run
counters to ``state.json``, the RNGs to ``rng/``. It decides nothing about
*when* to save (:mod:`core.stop_policy` does); it decides *how*: one save in
flight, every rank agreeing on failure, never from NaN/inf state, committed
with checksums, then pruned by :mod:`checkpointing.retention` (only this run's own
verified checkpoints; never the lowest-loss one). The folder layout and
verification are in :mod:`checkpointing.folders`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from checkpointing import hyperparams, integrity, ownership, replicas, retention, tokenizer_copy
from checkpointing.durable_io import replace_durable, sync_dir, write_durable
from checkpointing.folders import (
    BEST_FILE,
    CHECKPOINT_FORMAT,
    COMMIT_MARKER,
    CURRENT_RUN_FILE,
    EXIT_SAVE_FAILED,
    LINEAGE_FILE,
    SETTING_ASIDE_FILE,
    STATE_FILE,
    CheckpointOptions,
    SaveFailed,
    committed,
    current_run,
    io_error,
    lineage_of,
    plain,
    read_json,
    step_dir,
    verifies,
    verify,
)
from checkpointing.rng import rng_state, set_rng_state
from checkpointing.room import make_room
from core import log
from core.errors import EXIT_BAD_INPUT, CheckpointError, PluginError
from core.protocols import DistInfo, loader_state_per_rank
from liveness import watchdog


@dataclass
class TrainingState:
    """Everything a checkpoint holds, by part (``checkpoint.exclude_from_loading`` names them):
    ``model`` and ``optimizer`` (DCP shards), ``lr_schedule`` (``scheduler``), ``data``
    (``loader``'s position), ``train`` (``run``: step, tokens, ``run.state``) and ``rng``."""

    model: torch.nn.Module  # the unwrapped module: its state dict names are the checkpoint's
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: Any
    run: Any  # core.run.Run


class CheckpointDir:
    """A checkpoint folder as every rank of this job sees it: its options, and the process
    group its collectives use. Exists before any training state (resume checks candidates with it)."""

    def __init__(self, opts: CheckpointOptions, root: Path, dist: DistInfo, control: Any) -> None:
        self.opts, self.root, self.dist, self.control = opts, root, dist, control
        self.group = None
        if dist.world_size > 1:
            from core.distributed import gloo_group

            # DCP collectives get a gloo group of their own: async saves run them from a background
            # thread, beside the training collectives. It waits for a hung rank as long as they do.
            self.group = gloo_group()
            from checkpointing.shared_folder import check_shared

            # one folder that every node sees, before any checkpoint is read or written (exit 2 if not)
            check_shared(self, "[checkpoint].dir" if opts.dir else "the checkpoint folder <output_dir>/checkpoints")

    def agree(self, value: int, op: str = "min") -> int:
        """The same integer on every rank (min or sum over the checkpoint group)."""
        if self.group is None:
            return value
        import torch.distributed as tdist

        t = torch.tensor([value], dtype=torch.int64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MIN if op == "min" else tdist.ReduceOp.SUM, group=self.group)
        return int(t.item())

    def own(self, lineage: str) -> list[Path]:
        """This run's committed checkpoints, oldest first."""
        return [p for p in committed(self.root) if lineage_of(p) == lineage]


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

    def _check_finite(self, step: int, state: dict[str, Any]) -> None:
        """Refuse to write NaN or inf: raise NonFiniteState (on every rank) if any shard holds one."""
        from checkpointing.finite import count_nonfinite
        from core.nonfinite import NonFiniteState

        bad, total = count_nonfinite(state)
        bad, total = self.where.agree(bad, "sum"), self.where.agree(total, "sum")
        if bad:
            done = self.where.own(self.lineage)
            last = f"the last checkpoint, {done[-1]}, is kept" if done else "no checkpoint of this run exists yet"
            raise NonFiniteState(f"step {step}: {bad} of {total} model/optimizer tensors hold NaN or inf; not writing a checkpoint from them ({last})")

    def _claim(self, path: Path) -> bool:
        """Make ``path`` ready for this run's save (rank 0). Leftovers of this run's interrupted or
        damaged save of the same step are replaced. Another run's committed checkpoint is never
        touched (False: the save is skipped). An uncommitted folder of another run (or of none) is a
        save whose writer is dead (this job holds the folder's lock): it is moved to ``abandoned/``,
        never deleted, and so is a sound checkpoint of this run's (a branch left)."""
        if path.exists():
            ours, done = lineage_of(path) == self.lineage, (path / COMMIT_MARKER).is_file()
            if done and not ours:
                log.warn(f"{path} belongs to another run; not overwriting it, this save is skipped")
                return False
            what = "a checkpoint of this run's from another branch" if ours else "an interrupted save of another run"
            if ours and not (done and verifies(path)):
                retention.remove(path)  # what a save wrote; anything else stays, and is set aside below
                what = "files no save wrote"
            if path.exists():
                dest = retention.set_aside(self.root, [path], f"before_{path.name}")
                log.note(f"{path.name} held {what}; moved to {dest} (kept, never resumed from automatically)")
        (path / "rng").mkdir(parents=True)
        self.made = path  # this save's own folder: a failure removes what it wrote there, and only then
        write_durable(path / LINEAGE_FILE, self.lineage + "\n")
        return True

    # ---- state ----
    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return {
            "model": get_model_state_dict(self.state.model),
            "optimizer": get_optimizer_state_dict(self.state.model, self.state.optimizer),
        }

    def _written_share(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's share of ``state`` (:mod:`checkpointing.replicas`): every DTensor shard it
        holds and the replicated tensors it writes, so that an async save copies only those. If
        the ranks do not see the same replicated tensors, each passes all of them and DCP picks."""
        if self.group is None:
            return state
        mine = replicas.agreed_share(state, self.dist.rank, self.dist.world_size, self.where.agree)
        if mine is None:
            if not self.mixed_replicas_said:
                self.mixed_replicas_said = True
                log.warn("the ranks' replicated model/optimizer tensors differ in names, shapes or dtypes; every rank copies all of them for a save")
            return state
        return mine

    def _json_state(self, train_loss: float | None) -> dict[str, Any]:
        run = self.state.run
        sched = {k: plain(v) for k, v in self.state.scheduler.state_dict().items() if k != "lr_lambdas"}
        return {
            "format": CHECKPOINT_FORMAT,
            "step": run.step,
            "tokens_seen": run.tokens_seen,
            "train": dict(run.state),  # JSON values only (_check_run_state)
            "lr_schedule": sched,
            "data": {} if loader_state_per_rank(self.state.loader) else self.state.loader.state_dict(),
            "optimizer_plugin": self.about["optimizer_plugin"],
            "world_size": self.dist.world_size,
            "config": run.config,
            "versions": self.about["versions"],
            "data_fingerprint": self.about.get("data_fingerprint"),
            "architecture": self.about.get("architecture"),  # resolved architecture values (checkpointing.architecture)
            "tokenizer": self.about.get("tokenizer"),  # the data source's declared tokenizer (dataloading.tokenizer_spec)
            "train_loss": train_loss,  # mean over the steps since the previous save (retention)
            "saved_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    # ---- save ----
    def maybe_save(self, step: int, use_async: bool | None = None) -> None:
        """Save at ``step`` unless it was already saved."""
        if step == self.last_saved_step:
            return
        self.save(step, use_async=self.opts.async_save if use_async is None else use_async)

    def save(self, step: int, use_async: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        from checkpointing.safe_dcp import HashingFileSystemWriter

        self.wait()  # one save in flight at a time
        self.made = None
        watchdog.progress(f"saving the checkpoint of step {step} (checking and claiming it)")
        self._check_run_state()
        started = time.perf_counter()
        use_async = self._async_possible() if use_async else False
        state = self._dcp_state()
        self._check_finite(step, state)
        state = self._written_share(state)
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
        self._fail_together(error, step, path)
        claimed = self.where.agree(claimed)
        if claimed < 0:  # one line from rank 0, exit code 2 (launchers never restart it); that job keeps the folder
            from checkpointing.resume import stop_every_rank

            stop_every_rank(self.where, in_use or "")
        if not claimed:
            return
        try:
            write_durable(path / "rng" / f"rank_{self.dist.rank}.json", json.dumps(rng_state()))
            if loader_state_per_rank(self.state.loader):  # streaming sources: each rank's own position
                write_durable(path / "rng" / f"data_rank_{self.dist.rank}.json", json.dumps(self.state.loader.state_dict()))
        except OSError as e:
            error = e
        self._fail_together(error, step, path)  # no rank enters DCP's collectives unless every rank got this far
        json_state = self._json_state(self.losses.mean_and_reset())
        self.writer = HashingFileSystemWriter(path)  # each block it writes is progress of the phase that waits for it (liveness.watchdog)
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
        self._fail_together(error, step, path)
        self.last_saved_step = step
        if self.dist.is_main:
            kind = "async" if use_async else "sync"
            log.info(f"checkpoint step {step}: {kind} save stalled training {self.last_stall_s:.3f} s")

    def _check_run_state(self) -> None:
        """Rank 0's ``run.state`` (the one a checkpoint saves) must be JSON: a monitor's set or tensor
        there was a TypeError traceback mid-save (exit 1, which launchers restart into the same crash),
        or, at the top level, silently left out of the checkpoint. Now every rank stops, exit 2, and
        rank 0 names the key, before anything of this save is written."""
        why = None
        for key, value in self.state.run.state.items() if self.dist.is_main else ():
            try:
                json.dumps(value)
            except (TypeError, ValueError) as e:
                why = f"run.state[{key!r}] is not a JSON value ({e}); a monitor keeps only JSON values there (numbers, strings, lists, dicts): every checkpoint saves them"
                break
        if self.where.agree(int(why is not None), "sum"):
            if why is not None:
                raise PluginError(why)
            raise SystemExit(EXIT_BAD_INPUT)  # rank 0 says why, once

    def stager(self) -> Any:
        """The run's :class:`checkpointing.staging.HostStager`: async saves copy the state into
        host buffers it keeps, in a background thread, while training goes on."""
        if self._stager is None:
            from checkpointing.staging import HostStager

            self._stager = HostStager(self.dist.device)
        return self._stager

    def _async_possible(self) -> bool:
        """False, on every rank, once any rank could not allocate the host buffers of async saves:
        the run goes on with sync saves (said once) rather than stop at its first save."""
        short = self._stager.out_of_memory() if self._stager is not None else ""
        if self.where.agree(int(not short), "min"):
            return True
        if not self.sync_fallback:
            self.sync_fallback = True
            why = short or "another rank had no host memory for its copy"
            log.warn(f"async saves need host memory for a copy of the state and {why}; saving synchronously from now on", all_ranks=bool(short))
        return False

    def before_update(self) -> None:
        """Called before each optimizer step: wait for an async save's copy of the state; and once
        the optimizer state exists, have the host buffers of async saves allocated in the
        background, so that the first save does not hold training while they are pinned."""
        self.wait_for_staging()
        if self.opts.async_save and self._stager is None and self.state.optimizer.state:
            self.stager().prepare(self._written_share(self._dcp_state()))

    def wait_for_staging(self) -> None:
        """Block until an async save's copy of the state is made. Called before anything changes
        the state (the optimizer step, a load); the wait counts in ``last_stall_s``."""
        if self.staging is None:
            return
        watchdog.progress(f"waiting for the async save's copy of the state (step {self.last_saved_step})", waits=True)
        t0 = time.perf_counter()
        staging, self.staging = self.staging, None
        try:
            staging.result()
        except BaseException:  # noqa: BLE001 - the upload future fails with it; wait() reports that
            pass
        else:
            if not self.held_said and self.dist.is_main:
                self.held_said = True
                pinned = ", pinned" if self.dist.device.type == "cuda" else ""
                log.info(f"async saves keep {self._stager.held_bytes() / 2**20:,.1f} MiB of host memory on rank 0 for their copy{pinned} (each rank its share)")
        waited = time.perf_counter() - t0
        self.last_stall_s += waited
        if waited >= 0.1 and self.dist.is_main:
            log.info(f"checkpoint step {self.last_saved_step}: training waited {waited:.3f} s more for the async save's copy of the state")

    def poll(self) -> None:
        """Commit a finished async save (called at step boundaries; never blocks). While a
        save is in flight, one small all-reduce per step makes every rank commit (and agree
        on a failure) at the same step."""
        if self.pending is None:
            return
        not_done = int(not self.pending[0].done())
        if self.dist.world_size > 1:
            not_done = self.where.control.max([not_done])[0]
        if not not_done:
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight is written, then commit it."""
        if self.pending is None:
            return
        self.wait_for_staging()
        future, step, path, json_state = self.pending
        watchdog.progress(f"waiting for the async save of step {step} to be written", waits=True)  # its writer's blocks are progress
        self.pending = None
        error = None
        try:
            future.result()
            self._commit(step, path, json_state)
        except BaseException as e:
            error = io_error(e)
            if error is None:
                raise
        self._fail_together(error, step, path)

    def _fail_together(self, error: BaseException | None, step: int, path: Path) -> None:
        """Every rank learns whether any rank failed to write this save. If one did, rank 0
        removes what this save wrote (its own step folder, never an older checkpoint) unless
        it was already committed, and every rank raises :class:`SaveFailed`."""
        mine = f"{type(error).__name__}: {error}" if error is not None else ""
        if isinstance(error, RuntimeError):
            mine = f"torch's file writer failed, disk full? ({str(error).splitlines()[0]})"
        if self.dist.world_size > 1:
            import torch.distributed as tdist

            if not self.where.control.max([int(error is not None)])[0]:
                return
            errors: list[str] = [""] * self.dist.world_size
            tdist.all_gather_object(errors, mine, group=self.where.control.group)
        elif error is None:
            return
        else:
            errors = [mine]
        rank = next(r for r, m in enumerate(errors) if m)
        kept = ""
        if self.dist.is_main:
            if (path / COMMIT_MARKER).is_file():
                kept = f"; {path.name} was committed before the error and is kept"
            elif self.made == path and lineage_of(path) in (None, self.lineage):  # made by this save (None: its LINEAGE write failed)
                retention.remove(path)  # what a save writes; a folder that was there before the claim is never touched
            (self.root / (BEST_FILE + ".tmp")).unlink(missing_ok=True)
        done = [p.name for p in committed(self.root)]
        last = f"the last complete checkpoint is {done[-1]}" if done else "there is no complete checkpoint"
        raise SaveFailed(f"checkpoint save at step {step} failed on rank {rank}: {errors[rank]}{kept}; {last}; stopping (exit code {EXIT_SAVE_FAILED})", step)

    def _commit(self, step: int, path: Path, json_state: dict[str, Any]) -> None:
        # DCP's save returns (or its future resolves) on rank 0 only after every
        # rank reported its writes (each fsynced), so rank 0 alone can commit. The marker reaches
        # the disk after everything it lists, and is on disk before any older checkpoint is pruned
        # (checkpointing.durable_io: a machine crash, not only a killed process).
        watchdog.progress(f"committing the checkpoint of step {step}")
        if self.dist.is_main:
            ownership.fence()  # a run folder another job took while this one was stopped: no commit there, exit 2 at once
            json_state = dict(json_state, tokenizer=tokenizer_copy.record_for(path, json_state.get("tokenizer")))  # findable when moved
            write_durable(path / STATE_FILE, json.dumps(json_state, indent=1))
            sync_dir(path / "rng")
            sync_dir(path)
            manifest = {"step": step, "world_size": self.dist.world_size, **integrity.manifest_files(path, exclude=COMMIT_MARKER, known=self.writer.checksums)}
            replace_durable(path / COMMIT_MARKER, json.dumps(manifest, indent=1))
            sync_dir(self.root)  # the step folder's own name
            if step == self.best_step:
                retention.write_best(self.root, self.state.run.state.get("best_checkpoints", []))
            watchdog.progress(f"pruning old checkpoints after the commit of step {step}")
            self.retention.prune(self.lineage, self.pending[2] if self.pending is not None else None)
        self.on_saved(step, str(path))

    def save_best(self, step: int) -> None:
        """A validation at ``step`` entered the top ``keep_best`` (``run.state["best_checkpoints"]``,
        the same on every rank): save this step (its commit rewrites BEST.json), or, if it is
        already committed, just rewrite BEST.json."""
        self.best_step = step
        if step != self.last_saved_step:
            self.maybe_save(step)
        elif self.pending is None and self.dist.is_main:
            retention.write_best(self.root, self.state.run.state.get("best_checkpoints", []))

    def rollback_target(self) -> Path | None:
        """The checkpoint a rollback restores: this run's newest that every rank finds sound, its
        shards' checksums included (each rank a share, :func:`checkpointing.resume.check_here`); a
        damaged one is skipped with a warning. The save in flight is committed first (its commit
        prunes; listing before it could name a checkpoint that pruning then deletes)."""
        from checkpointing import resume

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

    # ---- load ----
    def load(self, path: Path, exclude: frozenset[str] = frozenset()) -> None:
        """Restore the state from ``path`` (its shards already checked by :mod:`checkpointing.resume`, or
        saved by this run), leaving out ``checkpoint.exclude_from_loading`` and ``exclude``.
        May fail half-way, leaving the state mixed: the caller builds it afresh then."""
        self.wait_for_staging()  # an async save may still be copying the state this load overwrites
        watchdog.progress(f"loading the checkpoint {path}")
        skip = set(self.opts.exclude_from_loading) | set(exclude)
        meta = verify(path, shards=False)
        current_opt = self.about["optimizer_plugin"]
        if "optimizer" not in skip and meta.get("optimizer_plugin") != current_opt:
            skip.add("optimizer")
            log.warn(
                f"checkpoint {path} holds optimizer state of {meta.get('optimizer_plugin')!r}, "
                f"this run uses {current_opt!r}: loading the weights and starting the optimizer fresh"
            )
        mine = hyperparams.settings(self.state.optimizer)  # this run's config: it wins over the checkpoint's settings
        self._load_shards(path, skip)
        changed = hyperparams.reapply(self.state.optimizer, mine)
        self._load_json_parts(path, meta, skip, changed)
        self.last_saved_step = self.state.run.step
        if self.dist.is_main:
            hyperparams.say_restored(path, meta, skip, self.state, self.dist.world_size)
            hyperparams.say_changes(path, changed)
            hyperparams.seed_changed(path, meta, self.about["seed"])
            hyperparams.config_changed(path, meta, self.state.run.config)
            hyperparams.data_changed(path, meta, self.about.get("data_fingerprint"))

    def _load_shards(self, path: Path, skip: set[str]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from checkpointing import safe_dcp
        from checkpointing.finite import count_nonfinite

        model, optimizer = self.state.model, self.state.optimizer
        shards: dict[str, Any] = {}
        if "model" not in skip:
            shards["model"] = get_model_state_dict(model)
        if "optimizer" not in skip:
            shards["optimizer"] = get_optimizer_state_dict(model, optimizer)
        if not shards:
            return
        safe_dcp.load(shards, path, self.group)
        bad = self.where.agree(count_nonfinite(shards)[0], "sum")
        if bad:
            raise CheckpointError(f"checkpoint {path} holds NaN or inf in {bad} tensor(s); it cannot be trained from")
        if "model" in shards:
            set_model_state_dict(model, shards["model"])
        if "optimizer" in shards:
            set_optimizer_state_dict(model, optimizer, shards["optimizer"])

    def _load_json_parts(self, path: Path, meta: dict[str, Any], skip: set[str], changed: dict[str, Any]) -> None:
        run, scheduler, loader, rank = self.state.run, self.state.scheduler, self.state.loader, self.dist.rank
        if "train" not in skip:
            run.step = int(meta["step"])
            run.tokens_seen = int(meta["tokens_seen"])
            run.state.update(meta.get("train", {}))
        if "lr_schedule" not in skip:
            sched = scheduler.state_dict()
            peaks = list(sched["base_lrs"])  # this run's config
            sched.update(meta["lr_schedule"])
            scheduler.load_state_dict(sched)
            for group, lr in zip(self.state.optimizer.param_groups, hyperparams.next_lrs(scheduler, peaks, changed)):
                if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep lr in a tensor
                    group["lr"].fill_(float(lr))
                else:
                    group["lr"] = float(lr)
        same_world = meta.get("world_size") == self.dist.world_size
        if "data" not in skip:
            from checkpointing.resume import check_data_position

            check_data_position(path, meta, run.config, loader_state_per_rank(loader), rank, self.dist.world_size)
            if loader_state_per_rank(loader):
                loader.load_state_dict(read_json(path / "rng" / f"data_rank_{rank}.json"))
            else:
                loader.load_state_dict(meta["data"])
        if "rng" not in skip:
            rng_file = path / "rng" / f"rank_{rank}.json"
            if same_world and rng_file.is_file():
                try:
                    set_rng_state(read_json(rng_file))
                except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
                    raise CheckpointError(f"{rng_file} is not an RNG state ({type(e).__name__}: {e})") from None
            else:
                torch.manual_seed(self.about["seed"] + run.step * 1000 + rank)
