"""Durable run state through ``torch.distributed.checkpoint`` (DCP).

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
  its shards while writing them, :mod:`core.safe_dcp`). A folder without it,
  or whose files do not match it, is never resumed from (:mod:`core.integrity`).

Checkpoints are read only through :class:`core.safe_dcp.SafeFileSystemReader`,
which runs no code from the files.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core import integrity, log
from core.errors import CheckpointError
from core.options import option
from core.protocols import loader_state_per_rank

COMMIT_MARKER = "COMMITTED"
BEST_FILE = "BEST.json"  # lists the checkpoints with the best validation losses (checkpoint.keep_best)
STATE_FILE = "state.json"
PARTS = ("model", "optimizer", "lr_schedule", "data", "train", "rng")
LINEAGE_FILE = "LINEAGE"  # the run (lineage id) that wrote this folder; written first, before any shard
EXIT_SAVE_FAILED = 74  # a save could not be written (disk full, I/O error); sysexits' EX_IOERR
# A single process saving or loading without a process group is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass
class CheckpointOptions:
    every: int = option(0, "steps between checkpoints; 0 saves only at the end and on a stop")
    dir: str = option("", "folder of checkpoints; empty means <train.output_dir>/checkpoints")
    async_save: bool = option(False, "write with dcp.async_save while training goes on", key="async")
    keep_latest: int = option(3, "complete checkpoints to keep, older ones are deleted; 0 keeps all")
    resume: str = option("auto", "'auto' (latest complete checkpoint in dir), 'none', or a checkpoint folder", path=True)
    exclude_from_loading: list[str] = option([], "parts not loaded on resume: model, optimizer, lr_schedule, data, train, rng")
    at_end: bool = option(True, "save when training completes")
    on_stop: bool = option(True, "save when SIGTERM/SIGINT or a monitor stops the run (unless the monitor says no)")
    keep_best: int = option(0, "keep the N checkpoints with the best validation loss through pruning: a validation in the top N saves its step; <dir>/BEST.json lists them, best first; 0: off")
    initial_load: str = option("", "weights to start from when not resuming: a checkpoint folder, a safetensors export or a Hugging Face folder", path=True)
    allow_foreign: bool = option(False, "start a fresh run (resume = 'none') in a folder that holds another run's checkpoints; they are left untouched, never pruned")

    def check(self) -> None:
        bad = [p for p in self.exclude_from_loading if p not in PARTS]
        if bad:
            raise ValueError(f"exclude_from_loading: unknown part {bad[0]!r}; parts: {', '.join(PARTS)}")
        if self.every < 0 or self.keep_latest < 0 or self.keep_best < 0:
            raise ValueError("every, keep_latest and keep_best must be >= 0")


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


def committed(root: Path) -> list[Path]:
    """Folders with a commit marker, oldest first (by step)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / COMMIT_MARKER).is_file())


def lineage_of(path: Path) -> str | None:
    """The id of the run that wrote checkpoint folder ``path``; None if unknown (another tool, or plait before lineages)."""
    try:
        return (path / LINEAGE_FILE).read_text().strip() or None
    except OSError:
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
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {COMMIT_MARKER} marker (interrupted save?)")
    return integrity.read_manifest(marker)


def verify(path: Path, shards: bool = True) -> dict[str, Any]:
    """Check that ``path`` is a complete, undamaged checkpoint; return its state.json.

    Checks every listed file's size and checksum, that the DCP metadata is
    made of nothing but DCP metadata (:mod:`core.safe_dcp`), and that
    state.json has the keys a resume reads. ``shards=False`` leaves out the
    checksums of the DCP shards (the bulk of the bytes): a resume checks those
    after the process group exists, each rank a share (:mod:`core.resume`).
    Raises CheckpointError.
    """
    from core.safe_dcp import load_metadata

    manifest = read_manifest(path)
    integrity.check_sizes(path, manifest, exclude=COMMIT_MARKER)
    integrity.check_checksums(path, manifest, manifest.small_files() + (manifest.shards() if shards else []))
    load_metadata(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is corrupt ({e})") from None
    integrity.check_state(state, path / STATE_FILE)
    return state


def _verifies(path: Path) -> bool:
    try:
        verify(path, shards=False)  # complete and sound; the shards' checksums are read only to resume
        return True
    except CheckpointError:
        return False


def check_shapes(path: Path, model: torch.nn.Module) -> None:
    """Compare the checkpoint's model tensors with ``model`` (may live on meta). Raises CheckpointError."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from core.safe_dcp import load_metadata

    meta = load_metadata(path)
    saved = {
        k[len("model."):]: tuple(v.size)
        for k, v in meta.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(saved))
    mismatched = sorted(k for k in set(want) & set(saved) if want[k] != saved[k])
    if mismatched:
        details = ", ".join(f"{k} {saved[k]} vs model {want[k]}" for k in mismatched[:4])
        more = f" and {len(mismatched) - 4} more" if len(mismatched) > 4 else ""
        raise CheckpointError(f"checkpoint {path} does not fit the model: {details}{more}")
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks model keys: {', '.join(missing[:6])}")


def check_fits(opts: CheckpointOptions, path: Path, model_meta: torch.nn.Module | None) -> None:
    """A model that changed shape is the user's mistake, not damage: an error, never a
    fallback (starting fresh would later prune the run's real checkpoints)."""
    if model_meta is not None and "model" not in opts.exclude_from_loading:
        check_shapes(path, model_meta)


def warn(message: str) -> None:
    """A one-line warning, from rank 0 only."""
    if int(os.environ.get("RANK", 0)) == 0:
        log.warn(f"{message}")


def find_resume(opts: CheckpointOptions, root: Path, model_meta: torch.nn.Module | None) -> list[Path]:
    """The checkpoints to try resuming from, best first, checked before any process group exists.

    An explicit path must pass :func:`verify` without the shard checksums, and
    fit the model, or it is an error. ``resume = "auto"``: the newest complete
    checkpoint that passes the same checks, then every older one (checked
    later, should the first fail the checks made after the process group
    exists, :mod:`core.resume`); each damaged one is skipped with a warning.
    """
    refuse_foreign(opts, root)
    if opts.resume == "none":
        return []
    if opts.resume != "auto":
        path = Path(opts.resume)
        verify(path, shards=False)
        check_fits(opts, path, model_meta)
        return [path]
    done = list(reversed(committed(root)))
    for i, path in enumerate(done):
        try:
            verify(path, shards=False)
        except CheckpointError as e:  # damaged: fall back to the one before
            warn(f"skipping checkpoint: {e}")
            continue
        check_fits(opts, path, model_meta)
        return done[i:]
    if done:
        warn(f"no usable checkpoint in {root}: starting fresh")
    return []


def read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
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


# --- RNG ---------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state().tolist()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


# --- saving and loading --------------------------------------------------------

class Checkpointer:
    """Saves and loads the trainer's state; one per process."""

    def __init__(self, opts: CheckpointOptions, root: Path, trainer: Any) -> None:
        self.opts = opts
        self.root = root
        self.t = trainer
        self.dist = trainer.dist
        self.pending: tuple[Any, int, Path, dict[str, Any]] | None = None  # (future, step, path, state.json)
        self.last_saved_step = -1
        self.best_step = -1
        self.last_stall_s = 0.0
        self.group = None
        self.writer: Any = None  # the storage writer of the save in flight (its shard checksums)
        if self.dist.world_size > 1:
            import torch.distributed as tdist

            # DCP collectives get a gloo group of their own: async saves run them
            # from a background thread, beside the training collectives.
            self.group = tdist.new_group(backend="gloo")

    @property
    def lineage(self) -> str:
        """This run's id: made at a fresh start, carried through every resume (``run.state``)."""
        return self.t.run.state["lineage"]

    def _agree(self, value: int, op: str = "min") -> int:
        """The same integer on every rank (min or sum over the checkpoint group)."""
        if self.group is None:
            return value
        import torch.distributed as tdist

        t = torch.tensor([value], dtype=torch.int64)
        tdist.all_reduce(t, op=tdist.ReduceOp.MIN if op == "min" else tdist.ReduceOp.SUM, group=self.group)
        return int(t.item())

    def _check_finite(self, step: int, state: dict[str, Any]) -> None:
        """Refuse to write NaN or inf: raise NonFiniteState (on every rank) if any shard holds one."""
        from core.nonfinite import NonFiniteState, count_nonfinite

        bad, total = count_nonfinite(state)
        bad, total = self._agree(bad, "sum"), self._agree(total, "sum")
        if bad:
            done = [p for p in committed(self.root) if lineage_of(p) == self.lineage]
            last = f"the last checkpoint, {done[-1]}, is kept" if done else "no checkpoint of this run exists yet"
            raise NonFiniteState(f"step {step}: {bad} of {total} model/optimizer tensors hold NaN or inf; "
                                 f"not writing a checkpoint from them ({last})")

    def _claim(self, path: Path) -> bool:
        """Make ``path`` ready for this run's save (rank 0): leftovers of this run's interrupted save
        of the same step are replaced; a folder another run wrote is never touched (False)."""
        if path.exists():
            if lineage_of(path) != self.lineage:
                log.warn(f"{path} belongs to another run; not overwriting it, this save is skipped")
                return False
            shutil.rmtree(path)
        (path / "rng").mkdir(parents=True)
        (path / LINEAGE_FILE).write_text(self.lineage + "\n")
        return True

    # ---- state ----
    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return {
            "model": get_model_state_dict(self.t.model),
            "optimizer": get_optimizer_state_dict(self.t.model, self.t.optimizer),
        }

    def _json_state(self) -> dict[str, Any]:
        run = self.t.run
        sched = {k: plain(v) for k, v in self.t.scheduler.state_dict().items() if k != "lr_lambdas"}
        return {
            "step": run.step,
            "tokens_seen": run.tokens_seen,
            "train": {k: v for k, v in run.state.items() if isinstance(v, (int, float, str, bool, list, dict))},
            "lr_schedule": sched,
            "data": {} if loader_state_per_rank(self.t.loader) else self.t.loader.state_dict(),
            "optimizer_plugin": self.t.rc.slots["optimizer"].component.name,
            "world_size": self.dist.world_size,
            "config": run.config,
            "versions": self.t.versions,
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

        from core.safe_dcp import HashingFileSystemWriter

        self.wait()  # one save in flight at a time
        state = self._dcp_state()
        self._check_finite(step, state)
        path = step_dir(self.root, step)
        error: BaseException | None = None
        claimed = 1
        try:
            if self.dist.is_main:
                claimed = int(self._claim(path))
        except OSError as e:
            error = e
        self._fail_together(error, step, path)
        if not self._agree(claimed):
            return
        try:
            (path / "rng" / f"rank_{self.dist.rank}.json").write_text(json.dumps(rng_state()))
            if loader_state_per_rank(self.t.loader):  # streaming sources: each rank's own position
                (path / "rng" / f"data_rank_{self.dist.rank}.json").write_text(json.dumps(self.t.loader.state_dict()))
        except OSError as e:
            error = e
        self._fail_together(error, step, path)  # no rank enters DCP's collectives unless every rank got this far
        json_state = self._json_state()
        self.writer = HashingFileSystemWriter(path)
        t0 = time.perf_counter()
        try:
            if use_async:
                future = dcp.async_save(state, storage_writer=self.writer, process_group=self.group, no_dist=self.group is None)
                self.last_stall_s = time.perf_counter() - t0
                self.pending = (future, step, path, json_state)
            else:
                dcp.save(state, storage_writer=self.writer, process_group=self.group, no_dist=self.group is None)
                self.last_stall_s = time.perf_counter() - t0
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

    def poll(self) -> None:
        """Commit a finished async save (called at step boundaries; never blocks). While a
        save is in flight, one small all-reduce per step makes every rank commit (and agree
        on a failure) at the same step."""
        if self.pending is None:
            return
        not_done = int(not self.pending[0].done())
        if self.dist.world_size > 1:
            not_done = self.t.control.max([not_done])[0]
        if not not_done:
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight is written, then commit it."""
        if self.pending is None:
            return
        future, step, path, json_state = self.pending
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

            if not self.t.control.max([int(error is not None)])[0]:
                return
            errors: list[str] = [""] * self.dist.world_size
            tdist.all_gather_object(errors, mine, group=self.t.control.group)
        elif error is None:
            return
        else:
            errors = [mine]
        rank = next(r for r, m in enumerate(errors) if m)
        kept = ""
        if self.dist.is_main:
            if (path / COMMIT_MARKER).is_file():
                kept = f"; {path.name} was committed before the error and is kept"
            elif lineage_of(path) in (None, self.lineage):  # this run's (None: the LINEAGE write itself failed)
                shutil.rmtree(path, ignore_errors=True)
            (self.root / (BEST_FILE + ".tmp")).unlink(missing_ok=True)
        done = [p.name for p in committed(self.root)]
        last = f"the last complete checkpoint is {done[-1]}" if done else "there is no complete checkpoint"
        raise SaveFailed(f"checkpoint save at step {step} failed on rank {rank}: {errors[rank]}{kept}; "
                         f"{last}; stopping (exit code {EXIT_SAVE_FAILED})", step)

    def _commit(self, step: int, path: Path, json_state: dict[str, Any]) -> None:
        # DCP's save returns (or its future resolves) on rank 0 only after every
        # rank reported its writes, so rank 0 alone can commit.
        if self.dist.is_main:
            (path / STATE_FILE).write_text(json.dumps(json_state, indent=1))
            manifest = {"step": step, "world_size": self.dist.world_size,
                        **integrity.manifest_files(path, exclude=COMMIT_MARKER, known=self.writer.checksums)}
            tmp = path / (COMMIT_MARKER + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, path / COMMIT_MARKER)
            if step == self.best_step:
                self._write_best()
            self._prune()
        self.t.on_checkpoint_saved(step, str(path))

    def save_best(self, step: int) -> None:
        """A validation at ``step`` entered the top ``keep_best`` (``run.state["best_checkpoints"]``,
        the same on every rank): save this step (its commit rewrites BEST.json), or, if it is
        already committed, just rewrite BEST.json."""
        self.best_step = step
        if step != self.last_saved_step:
            self.maybe_save(step)
        elif self.pending is None and self.dist.is_main:
            self._write_best()

    def _write_best(self) -> None:
        ranking = [{"step": int(s), "path": step_dir(self.root, int(s)).name, "val_loss": loss}
                   for loss, s in self.t.run.state.get("best_checkpoints", [])]
        tmp = self.root / (BEST_FILE + ".tmp")
        tmp.write_text(json.dumps({"best": ranking}, indent=1))
        os.replace(tmp, self.root / BEST_FILE)

    def best_paths(self) -> set[Path]:
        try:
            return {self.root / b["path"] for b in json.loads((self.root / BEST_FILE).read_text())["best"]}
        except (OSError, ValueError, KeyError, TypeError):
            return set()

    def _prune(self) -> None:
        """Retention (rank 0, after a commit). Only this run's own checkpoints are ever deleted: of its
        verified ones the newest ``keep_latest`` stay, and so do the newest one and the ``keep_best``
        ones; its interrupted saves older than its newest verified checkpoint go too. Checkpoints of
        other runs, damaged ones and anything plait did not write are left alone."""
        mine = [p for p in committed(self.root) if lineage_of(p) == self.lineage]
        good = [p for p in mine if _verifies(p)]
        if not good:
            return
        keep = self.best_paths() | {good[-1]}
        if self.opts.keep_latest:
            for old in good[: -self.opts.keep_latest]:
                if old not in keep:
                    shutil.rmtree(old, ignore_errors=True)
        in_flight = self.pending[2] if self.pending is not None else None
        for p in self.root.glob("step_*"):
            if (p.name < good[-1].name and p != in_flight and not (p / COMMIT_MARKER).exists()
                    and lineage_of(p) == self.lineage):
                shutil.rmtree(p, ignore_errors=True)

    # ---- load ----
    def load(self, path: Path) -> None:
        """Restore the trainer from ``path`` (its shards already checked by :mod:`core.resume`,
        or saved by this run). May fail half-way, leaving the trainer's state mixed."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from core import safe_dcp

        t, run = self.t, self.t.run
        skip = set(self.opts.exclude_from_loading)
        meta = verify(path, shards=False)
        current_opt = t.rc.slots["optimizer"].component.name
        if "optimizer" not in skip and meta.get("optimizer_plugin") != current_opt:
            skip.add("optimizer")
            log.warn(f"checkpoint {path} holds optimizer state of {meta.get('optimizer_plugin')!r}, "
                f"this run uses {current_opt!r}: loading the weights and starting the optimizer fresh")
        state: dict[str, Any] = {}
        if "model" not in skip:
            state["model"] = get_model_state_dict(t.model)
        if "optimizer" not in skip:
            state["optimizer"] = get_optimizer_state_dict(t.model, t.optimizer)
        if state:
            safe_dcp.load(state, path, self.group)
            from core.nonfinite import count_nonfinite

            bad = self._agree(count_nonfinite(state)[0], "sum")
            if bad:
                raise CheckpointError(f"checkpoint {path} holds NaN or inf in {bad} tensor(s); it cannot be trained from")
            if "model" in state:
                set_model_state_dict(t.model, state["model"])
            if "optimizer" in state:
                set_optimizer_state_dict(t.model, t.optimizer, state["optimizer"])
        if "train" not in skip:
            run.step = int(meta["step"])
            run.tokens_seen = int(meta["tokens_seen"])
            run.state.update(meta.get("train", {}))
        if "lr_schedule" not in skip:
            sched = t.scheduler.state_dict()
            sched.update(meta["lr_schedule"])
            t.scheduler.load_state_dict(sched)
            for group, lr in zip(t.optimizer.param_groups, t.scheduler.get_last_lr()):
                if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep lr in a tensor
                    group["lr"].fill_(float(lr))
                else:
                    group["lr"] = float(lr)
        if "data" not in skip:
            if loader_state_per_rank(t.loader):
                data_file = path / "rng" / f"data_rank_{self.dist.rank}.json"
                if meta.get("world_size") != self.dist.world_size or not data_file.is_file():
                    raise CheckpointError(f"checkpoint {path}: the streaming data position was saved on "
                                          f"{meta.get('world_size')} ranks and cannot resume on {self.dist.world_size}")
                t.loader.load_state_dict(read_json(data_file))
            else:
                t.loader.load_state_dict(meta["data"])
        if "rng" not in skip:
            rng_file = path / "rng" / f"rank_{self.dist.rank}.json"
            if meta.get("world_size") == self.dist.world_size and rng_file.is_file():
                try:
                    set_rng_state(read_json(rng_file))
                except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
                    raise CheckpointError(f"{rng_file} is not an RNG state ({type(e).__name__}: {e})") from None
            else:
                torch.manual_seed(t.rc.train.seed + run.step * 1000 + self.dist.rank)
        self.last_saved_step = run.step
        if self.dist.is_main:
            log.info(f"resumed from {path} at step {run.step} (saved on {meta.get('world_size')} ranks, now {self.dist.world_size})")
            lr = t.optimizer.param_groups[0]["lr"]
            position = t.loader.state_dict() if not loader_state_per_rank(t.loader) else {}
            data = f"sample {position['consumed_samples']:,}" if "consumed_samples" in position else "per-rank stream positions"
            parts = [f"tokens seen {run.tokens_seen:,}", f"lr {float(lr):.3g}", f"data at {data}"]
            if "optimizer" in skip:
                parts.append("optimizer started fresh")
            if skip - {"optimizer"}:
                parts.append(f"not restored: {', '.join(sorted(skip - {'optimizer'}))}")
            log.info(f"restored {'; '.join(parts)}")
