"""Every rank's view of a checkpoint folder (:class:`CheckpointDir`), the state a checkpoint holds
(:class:`TrainingState`), and choosing and loading the checkpoint to resume from.

Before any process group ``core.preflight`` lists the candidates (:func:`find_resume`). Once it
exists every rank takes part and all agree on every outcome: :meth:`CheckpointDir.first_sound`
checks each rank's share of the shards' checksums and the files it alone will read; the load
(:class:`Restorer`, called by :meth:`core.checkpoint.checkpointer.Checkpointer.restore`) can still
fail, and the trainer then builds its state afresh before the next candidate. With ``resume =
"auto"`` a dropped candidate is one warning and the next is tried; an explicit path that fails is
exit 2. A load refused because this run's config cannot continue it (``ConfigError``,
``DataError``) ends the run with exit 2 whatever ``resume`` says: every older checkpoint would fail
alike. This run's optimizer settings win over the checkpoint's (:func:`reapply`).
"""

from __future__ import annotations

import random
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.checkpoint.folders import (
    COMMIT_MARKER,
    CURRENT_RUN_FILE,
    LINEAGE_FILE,
    SETTING_ASIDE_FILE,
    CheckpointOptions,
    check_checksums,
    check_fits,
    check_shapes,
    checksum_share,
    committed,
    count_nonfinite,
    current_run,
    lineage_of,
    marked,
    read_json,
    read_manifest,
    read_small_json,
    step_dirs,
    verify,
    warn,
)
from core.contract import log
from core.contract.errors import EXIT_BAD_INPUT, CheckpointError, ConfigError
from core.contract.protocols import DataLoaderLike, DistInfo, loader_consumed_samples, loader_state_per_rank
from core.contract.run import Run
from core.runtime import distributed, watchdog
from core.runtime.durable_io import write_durable
from core.runtime.made_folders import remove_what_this_start_made


def agree(group: Any, error: str | None, bad_input: bool = False) -> str | None:
    """The first rank's error, on every rank (``None`` if all succeeded). An error a rank marked
    ``bad_input`` comes back as :class:`BadInput` (a ``str``), first among the ranks that had one."""
    errors: list[tuple[str | None, bool]] = distributed.agree((error, bad_input), "all", group)
    first = next((e for e, bad in errors if e and bad), None)
    return BadInput(first) if first else next((e for e, _ in errors if e), None)


class BadInput(str):
    """An agreed error that is this run's config, not the checkpoint's damage (exit code 2)."""


def check_here(where: CheckpointDir, path: Path) -> None:
    """This rank's part of checking candidate ``path``. Raises CheckpointError."""
    rank, world = where.dist.rank, where.dist.world_size
    state = verify(path, shards=False)
    manifest = read_manifest(path)
    check_checksums(path, manifest, checksum_share(manifest.shards(), manifest.sizes, rank, world))
    if state["world_size"] == world:
        rng = path / "rng" / f"rank_{rank}.json"
        if rng.is_file() and "rng" not in where.opts.exclude_from_loading:
            try:
                set_rng_state(read_json(rng))  # a trial: the trainer seeds its state afresh after this
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - valid JSON, not an RNG state
                raise CheckpointError(f"{rng} is not an RNG state ({type(e).__name__}: {e})") from None
        data = path / "rng" / f"data_rank_{rank}.json"
        if data.is_file():
            read_json(data)


def first_sound(
    where: CheckpointDir, candidates: list[Path], model_meta: torch.nn.Module | None, architecture: dict[str, Any] | None = None
) -> tuple[Path | None, list[Path]]:
    """The first candidate that every rank finds sound, and the ones after it, held to this run's
    model (``architecture``, :mod:`core.checkpoint.folders`, and shapes). Rank 0's list is
    every rank's: it was made once rank 0 held the folder's lock (the others' may be older)."""
    candidates = [Path(p) for p in distributed.agree([str(p) for p in candidates], "root", where.group)]
    for i, path in enumerate(candidates):
        error = None
        try:
            check_here(where, path)
        except CheckpointError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - every rank must reach agree(), whatever went wrong here
            error = one_line(path, "could not be checked", e)
        error = agree(where.group, error)
        if error is None:
            check_fits(where.opts, path, model_meta, architecture)
            return path, candidates[i + 1 :]
        drop(where, error, last=i == len(candidates) - 1)
    return None, []


def check_data_position(path: Path, meta: dict[str, Any], config: dict[str, Any], per_rank: bool, rank: int, world: int) -> None:
    """The data position ``path`` holds must be of the kind this run's loader keeps (``per_rank``: a
    stream's position per rank, else a global sample index), and a stream's must come from this
    world size. A mismatch is this run's config (ConfigError), a missing file of its own the
    checkpoint's damage (CheckpointError)."""
    saved_per_rank = (path / "rng" / "data_rank_0.json").is_file()
    was = meta.get("config", {}).get("data", {}).get("name") if isinstance(meta.get("config"), dict) else None
    now = config.get("data", {}).get("name")
    fix = f"resume with [data] name = {was!r} as saved, or set --checkpoint.exclude_from_loading='[\"data\"]' to start the data over"
    if per_rank and not saved_per_rank:
        raise ConfigError(
            f"checkpoint {path} holds a global data position (sample {meta.get('data', {}).get('consumed_samples', '?')}) of data source {was!r}; "
            f"this run's data source {now!r} streams, with a position per rank, and cannot continue from it: {fix}"
        )
    if saved_per_rank and not per_rank:
        raise ConfigError(
            f"checkpoint {path} holds the per-rank stream positions of data source {was!r}; this run's data source {now!r} "
            f"keeps a global sample index and cannot continue from them: {fix}"
        )
    if per_rank:
        check_stream_world(path, meta, world)
    if per_rank and not (path / "rng" / f"data_rank_{rank}.json").is_file():
        raise CheckpointError(f"checkpoint {path} lacks rng/data_rank_{rank}.json, its stream position for rank {rank}")


def check_stream_world(path: Path, meta: dict[str, Any], world: int) -> None:
    """Per-rank stream positions (a loader's ``per_rank_state``) resume only at the world size that saved
    them, whatever this run's loader; also checked before training (:mod:`core.preflight.start_folders`), so
    ``core.plan`` says it and no model is built for a start that must be refused."""
    saved_world = meta.get("world_size")
    if (path / "rng" / "data_rank_0.json").is_file() and saved_world != world:
        raise ConfigError(
            f"checkpoint {path}: the streaming data position was saved on {saved_world} ranks and cannot resume on {world} "
            "(resume at that world size, or --checkpoint.exclude_from_loading='[\"data\"]' to start the data over)"
        )


def stop_every_rank(where: CheckpointDir, error: str) -> None:
    """End the run on every rank with exit code 2: rank 0 raises ``error`` (one line), the others exit quietly."""
    if where.dist.is_main:
        raise CheckpointError(error)
    raise SystemExit(EXIT_BAD_INPUT)  # rank 0 says why, once


def one_line(path: Path, what: str, error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"checkpoint {path} {what}: {type(error).__name__}: {text[0] if text else ''}"


def drop(where: CheckpointDir, error: str, last: bool) -> None:
    """A candidate failed on some rank: warn and go on (auto), or end the run (an explicit path)."""
    if where.opts.resume != "auto":
        stop_every_rank(where, error)
    warn(f"skipping checkpoint: {error}")
    if last:
        warn(f"no usable checkpoint in {where.root}: starting fresh")


class CheckpointDir:
    """A checkpoint folder as every rank of this job sees it: its options, and the process
    group its collectives use. Exists before any training state (resume checks candidates with it)."""

    def __init__(self, opts: CheckpointOptions, root: Path, dist: DistInfo, control: distributed.ControlPlane) -> None:
        self.opts, self.root, self.dist, self.control = opts, root, dist, control
        self.group = None
        if dist.world_size > 1:
            # DCP collectives get a gloo group of their own: async saves run them from a background
            # thread, beside the training collectives. It waits for a hung rank as long as they do.
            self.group = distributed.gloo_group()
            # one folder that every node sees, before any checkpoint is read or written (exit 2 if not)
            check_shared(self, "[checkpoint].dir" if opts.dir else "the checkpoint folder <output_dir>/checkpoints")

    def agree(self, value: int, op: str = "min") -> int:
        """The same integer on every rank: :func:`core.runtime.distributed.agree` over the checkpoint group."""
        return int(distributed.agree(value, op, self.group))

    def own(self, lineage: str) -> list[Path]:
        """This run's committed checkpoints, oldest first."""
        return [p for p in committed(self.root) if lineage_of(p) == lineage]

    def first_sound(self, candidates: list[Path], model_meta: torch.nn.Module | None, architecture: dict[str, Any] | None) -> tuple[Path | None, list[Path]]:
        """:func:`first_sound` of ``candidates`` (newest first, from :func:`find_resume`) in this folder."""
        return first_sound(self, candidates, model_meta, architecture)


PROBE_PREFIX = ".plait-shared-probe-"
SEEN_WITHIN_S = 2.0  # a network file system may show another host's new file a moment late


def sees(path: Path, token: str, within_s: float = SEEN_WITHIN_S) -> bool:
    """Whether ``path`` holds ``token``, looking again for up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if path.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def check_shared(where: CheckpointDir, what: str) -> None:
    """End the run (exit code 2; one line from rank 0) unless every rank sees the file rank 0 wrote
    into its checkpoint folder. ``where``: a :class:`core.checkpoint.resume.CheckpointDir`
    (its root, its ranks, its gloo group); ``what``: how the config names the folder."""
    root, dist = Path(where.root), where.dist
    probe: Any = None
    if dist.is_main:
        name, token = f"{PROBE_PREFIX}{uuid.uuid4().hex}", f"{socket.gethostname()} {uuid.uuid4().hex}"
        try:
            write_durable(root / name, token)
            probe = (name, token)
        except OSError as e:
            probe = f"{type(e).__name__}: {e}"
    probe = distributed.agree(probe, "root", where.group)
    if isinstance(probe, str):  # rank 0 could not write there: the first save would say so, rank by rank
        return
    name, token = probe
    mine = (sees(root / name, token), socket.gethostname(), str(root))
    everyone: list[Any] = distributed.agree(mine, "all", where.group)
    if dist.is_main:
        (root / name).unlink(missing_ok=True)
    blind = [(r, host, folder) for r, (seen, host, folder) in enumerate(everyone) if not seen]
    if not blind:
        return
    if not mine[0]:  # the folders this rank's start made on its own disk stay only if something is in them
        remove_what_this_start_made()
    host0 = everyone[0][1]
    named = ", ".join(f"rank {r} on {host}" + (f" (its folder: {folder})" if folder != str(root) else "") for r, host, folder in blind[:4])
    more = f" and {len(blind) - 4} more" if len(blind) > 4 else ""
    stop_every_rank(
        where,
        f"{what} = {root}: {named}{more} cannot see the file that rank 0 on {host0} wrote there; every node must "
        f"write its shards into the same checkpoint folder (a shared file system, a ReadWriteMany volume), not a disk "
        f"of its own: set checkpoint.dir to a folder that every node mounts",
    )


@dataclass
class TrainingState:
    """Everything a checkpoint holds, by part (``checkpoint.exclude_from_loading`` names them):
    ``model`` and ``optimizer`` (DCP shards), ``lr_schedule`` (``scheduler``), ``data``
    (``loader``'s position), ``train`` (``run``: step, tokens, ``run.state``) and ``rng``."""

    model: torch.nn.Module  # the unwrapped module: its state dict names are the checkpoint's
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: DataLoaderLike
    run: Run

    @property
    def lineage(self) -> str:
        """This run's id: made at a fresh start, carried through every resume (``run.state``)."""
        return self.run.state["lineage"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    py = random.getstate()
    np_state: Any = np.random.get_state()  # a tuple with the legacy=True default
    out: dict[str, Any] = {
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


class Restorer:
    """Loads a checkpoint into ``state`` on the ranks of ``where``: the DCP shards (refused if they
    hold NaN or inf), then ``state.json``'s parts (step, schedule, data position) and the RNGs; this
    run's optimizer settings win over the checkpoint's (:mod:`core.checkpoint.resume`).
    ``about``: this run's facts the checkpoint's are held to (``optimizer_plugin``, ``seed``,
    ``data_fingerprint``)."""

    def __init__(self, where: CheckpointDir, state: TrainingState, about: dict[str, Any]) -> None:
        self.where, self.state, self.about = where, state, about

    def load(self, path: Path, skip: set[str]) -> None:
        """Restore the state from ``path`` (its shards already checked by :mod:`core.checkpoint.resume`, or
        saved by this run), leaving out the parts named in ``skip`` (:class:`TrainingState`'s parts).
        May fail half-way, leaving the state mixed: the caller builds it afresh then."""
        watchdog.progress(f"loading the checkpoint {path}")
        skip = set(skip)
        meta = verify(path, shards=False)
        current_opt = self.about["optimizer_plugin"]
        if "optimizer" not in skip and meta.get("optimizer_plugin") != current_opt:
            skip.add("optimizer")
            log.warn(
                f"checkpoint {path} holds optimizer state of {meta.get('optimizer_plugin')!r}, "
                f"this run uses {current_opt!r}: loading the weights and starting the optimizer fresh"
            )
        mine = settings(self.state.optimizer)  # this run's config: it wins over the checkpoint's settings
        self.load_shards(path, skip)
        changed = reapply(self.state.optimizer, mine)
        self.load_json_parts(path, meta, skip, changed)
        if self.where.dist.is_main:
            say_restored(path, meta, skip, self.state, self.where.dist.world_size)
            say_changes(path, changed)
            seed_changed(path, meta, self.about["seed"])
            config_changed(path, meta, self.state.run.config)
            data_changed(path, meta, self.about.get("data_fingerprint"))

    def load_shards(self, path: Path, skip: set[str]) -> None:
        """The model's and optimizer's DCP shards, unless ``skip`` names them; NaN or inf in them is refused."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from core.checkpoint import safe_dcp  # torch.distributed.checkpoint takes seconds to import: only once one is read

        model, optimizer = self.state.model, self.state.optimizer
        shards: dict[str, Any] = {}
        # a pipeline-parallel save flattens the optimizer's state (core.checkpoint.checkpointer): read it as it was written,
        # its groups' settings keyed by parameter name (optimizer.param_groups.<fqn>.lr), not by group index (...param_groups.0.lr)
        keys = safe_dcp.load_metadata(path).state_dict_metadata
        saved_flat = any(k.startswith("optimizer.param_groups.") and not k.split(".")[2].isdigit() for k in keys)
        flat = StateDictOptions(flatten_optimizer_state_dict=saved_flat or self.where.dist.pp > 1)
        groups: dict[str, Any] = {}  # a nested save read by pipeline stages: the state by the same names, the groups' settings this run's
        if "model" not in skip:
            shards["model"] = get_model_state_dict(model)
        if "optimizer" not in skip:
            shards["optimizer"] = get_optimizer_state_dict(model, optimizer, options=flat)
            if flat.flatten_optimizer_state_dict and not saved_flat:
                groups = {k: v for k, v in shards["optimizer"].items() if k.startswith("param_groups.")}
                shards["optimizer"] = {k: v for k, v in shards["optimizer"].items() if k not in groups}
        if not shards:
            return
        safe_dcp.load(shards, path, self.where.group)
        bad = self.where.agree(count_nonfinite(shards)[0], "sum")
        if bad:
            raise CheckpointError(f"checkpoint {path} holds NaN or inf in {bad} tensor(s); it cannot be trained from")
        if "model" in shards:
            set_model_state_dict(model, shards["model"])
        if "optimizer" in shards:
            set_optimizer_state_dict(model, optimizer, shards["optimizer"] | groups, options=flat)

    def load_json_parts(self, path: Path, meta: dict[str, Any], skip: set[str], changed: dict[str, Any]) -> None:
        """``state.json``'s parts (``meta``) and this rank's RNG and data files, unless ``skip`` names them;
        ``changed``: the optimizer settings this run's config changed (the schedule's next rates follow them)."""
        run, scheduler, loader, rank = self.state.run, self.state.scheduler, self.state.loader, self.where.dist.rank
        if "train" not in skip:
            run.step = int(meta["step"])
            run.tokens_seen = int(meta["tokens_seen"])
            run.state.update(meta.get("train", {}))
        if "lr_schedule" not in skip:
            sched = scheduler.state_dict()
            peaks = list(sched["base_lrs"])  # this run's config
            sched.update(meta["lr_schedule"])
            scheduler.load_state_dict(sched)
            for group, lr in zip(self.state.optimizer.param_groups, next_lrs(scheduler, peaks, changed)):
                if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep lr in a tensor
                    group["lr"].fill_(float(lr))
                else:
                    group["lr"] = float(lr)
        same_world = meta.get("world_size") == self.where.dist.world_size
        if "data" not in skip:
            check_data_position(path, meta, run.config, loader_state_per_rank(loader), rank, self.where.dist.world_size)
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


STATE_KEYS = frozenset({"params", "lr"})  # the parameters, and the LR the schedule sets each step


def _plain_setting(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return type(value)(_plain_setting(v) for v in value)
    return value


def settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups' settings as this run's config made them (call before loading)."""
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k not in STATE_KEYS} for g in optimizer.param_groups]


def reapply(optimizer: torch.optim.Optimizer, before: list[dict[str, Any]]) -> dict[str, tuple[Any, Any]]:
    """Put the config's settings back after a load; ``{key: (checkpoint's, config's)}`` for those that differed
    (one example per key; ``initial_lr`` is the group's peak LR)."""
    changed: dict[str, tuple[Any, Any]] = {}
    if len(before) != len(optimizer.param_groups):
        return changed
    for group, mine in zip(optimizer.param_groups, before):
        for key, value in mine.items():
            loaded = group.get(key)
            if _plain_setting(loaded) != _plain_setting(value):
                changed.setdefault(key, (_plain_setting(loaded), _plain_setting(value)))
                if isinstance(loaded, torch.Tensor) and isinstance(value, torch.Tensor) and loaded.shape == value.shape:
                    loaded.copy_(value)
                else:
                    group[key] = value
    return changed


def next_lrs(scheduler: Any, peaks: list[float], changed: dict[str, tuple[Any, Any]]) -> list[float]:
    """After the schedule's state is loaded (core/loop/assemble.py's ``LambdaLR``): this run's peak LRs back in
    place, and the LRs of the next step, the peak times the multiplier at the restored step."""
    if list(scheduler.base_lrs) != peaks:
        changed.setdefault("initial_lr", (scheduler.base_lrs[0], peaks[0]))
        scheduler.base_lrs = peaks
    lrs = [peak * multiplier(scheduler.last_epoch) for peak, multiplier in zip(peaks, scheduler.lr_lambdas)]
    scheduler._last_lr = lrs
    return lrs


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return str(value)


def say_changes(path: Path | str, changed: dict[str, tuple[Any, Any]]) -> None:
    if changed:
        parts = ", ".join(f"{'peak lr' if k == 'initial_lr' else k} {_show(old)} -> {_show(new)}" for k, (old, new) in sorted(changed.items()))
        log.note(f"checkpoint {path}: the optimizer settings it holds differ from this run's, which apply from the next step: {parts}")


def seed_changed(path: Path, meta: dict[str, Any], seed: int) -> None:
    """Warn when the seed differs from the checkpoint's: the data order from here on follows the new one."""
    saved = meta.get("config", {}).get("train", {}).get("seed")
    if isinstance(saved, int) and saved != seed:
        log.warn(
            f"checkpoint {path} was trained with train.seed = {saved}, this run uses {seed}: the data order from the "
            f"next step follows seed {seed}, so samples of the current epoch may repeat or be skipped"
        )


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``key old -> new`` for every config value that differs (``train.seed`` has a warning of its own;
    ``checkpoint.resume`` names the checkpoint, so it differs whenever one is named; ``derived`` is not
    config but what plait worked out from it, such as the world size, which the resume names itself)."""
    a, b = _flat(saved), _flat(now)
    ignored = ("train.seed", "checkpoint.resume")
    keys = sorted(k for k in a.keys() | b.keys() if k not in ignored and not k.startswith("derived.") and a.get(k) != b.get(k))
    return [f"{k} {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in keys]


def config_changed(path: Path, meta: dict[str, Any], config: dict[str, Any], shown: int = 8) -> None:
    """One line naming the config values that differ from the ones the checkpoint was saved with."""
    parts = config_differences(meta.get("config") or {}, config)
    if parts:
        more = f" and {len(parts) - shown} more" if len(parts) > shown else ""
        log.note(f"checkpoint {path}: the config differs from the one it was saved with: {', '.join(parts[:shown])}{more}")


def data_changed(path: Path, meta: dict[str, Any], fingerprint: str | None) -> None:
    """Warn when the data source's ``fingerprint()`` differs from the one saved in the checkpoint: the
    restored data position now indexes other data."""
    saved = meta.get("data_fingerprint")
    if saved and fingerprint and saved != fingerprint:
        position = loader_consumed_samples(meta.get("data", {}))
        at = f" (sample {position:,})" if position is not None else ""
        log.warn(
            f"checkpoint {path} was trained on other data ({saved}); this run's data is {fingerprint}: "
            f"the restored data position{at} now indexes different data"
        )


def say_restored(path: Path, meta: dict[str, Any], skip: set[str], state: TrainingState, world_size: int) -> None:
    """Two lines after a resume: where from, and what the restored state (``TrainingState``) holds."""

    run, loader = state.run, state.loader
    log.info(f"resumed from {path} at step {run.step} (saved on {meta.get('world_size')} ranks, now {world_size})")
    lr = state.optimizer.param_groups[0]["lr"]
    position = None if loader_state_per_rank(loader) else loader_consumed_samples(loader.state_dict())
    data = "per-rank stream positions" if loader_state_per_rank(loader) else "the loader's saved position" if position is None else f"sample {position:,}"
    parts = [f"tokens seen {run.tokens_seen:,}", f"lr {float(lr):.3g}", f"data at {data}"]
    if "optimizer" in skip:
        parts.append("optimizer started fresh")
    if skip - {"optimizer"}:
        parts.append(f"not restored: {', '.join(sorted(skip - {'optimizer'}))}")
    log.info(f"restored {'; '.join(parts)}")


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


def being_set_aside(root: Path) -> set[str]:
    """Checkpoint folders a start that was killed while moving a left branch aside had not moved
    yet (``SETTING_ASIDE.json``, :mod:`core.checkpoint.retention`): never resumed from; the next start moves them."""
    try:
        return set(read_small_json(root / SETTING_ASIDE_FILE))
    except (OSError, ValueError, TypeError):
        return set()


def refuse_restart_in_place(opts: CheckpointOptions, root: Path, path: Path, done: list[Path]) -> None:
    """Excluding ``train`` starts the step count and the run's lineage over. In a checkpoint folder
    that already holds checkpoints its saves would collide with them (each one skipped, the final
    one included), and a restart of the same command would start over once more. ``done``: the
    committed checkpoints in ``root``. Raises CheckpointError."""
    if "train" not in opts.exclude_from_loading or not done:
        return
    if path.parent.resolve() == root.resolve():
        why = f"in the folder of the checkpoints its saves would collide with ({root})"
    else:
        why = f"but {root} already holds checkpoints (a restart of this command?); to go on with them, resume without 'train' excluded"
    raise CheckpointError(
        f"checkpoint.exclude_from_loading has 'train': the run would start over at step 0 from {path}, {why}; a run that "
        f'starts over needs an empty checkpoint folder (--train.output_dir=... with checkpoint.resume = "{path}"), or '
        "start from the weights with checkpoint.initial_load"
    )


def find_resume(opts: CheckpointOptions, root: Path, model_meta: torch.nn.Module | None, architecture: dict[str, Any] | None = None) -> list[Path]:
    """The checkpoints to try resuming from, best first, checked before any process group exists.

    An explicit path must pass :func:`verify` without the shard checksums, and
    fit the model (its ``architecture`` and shapes), or it is an error. ``resume = "auto"``: the newest complete
    checkpoint that passes the same checks, then every older one (checked
    later, should the first fail the checks made after the process group
    exists, :mod:`core.checkpoint.resume`); each damaged one is skipped with a warning. Where the
    folder records the run that last trained into it (``CURRENT_RUN``), only that run's checkpoints
    are candidates: another run's beside them (``allow_foreign``) are never continued by a restart.
    """
    refuse_foreign(opts, root)
    if opts.resume == "none":
        return []
    if opts.resume != "auto":
        path = Path(opts.resume)
        verify(path, shards=False)
        check_fits(opts, path, model_meta, architecture)
        refuse_restart_in_place(opts, root, path, committed(root))
        return [path]
    aside, every = being_set_aside(root), committed(root)
    if (current := current_run(root)) is not None:
        others = [p for p in every if lineage_of(p) != current]
        every = [p for p in every if lineage_of(p) == current]
        for p in others:  # damage (a flipped bit) in the file that says whose it is: not silently passed over
            if lineage_of(p) is None:
                unknown_owner(p)
        if others and not every:
            warn(
                f"{root} holds {len(others)} checkpoint(s) of other runs and none of the run that last trained there "
                f"({CURRENT_RUN_FILE}): starting fresh; to continue one of them, name it (--checkpoint.resume=<its folder>)"
            )
    done = [p for p in reversed(every) if p.name not in aside]
    unmarked_newer(root, done[0] if done else None, current)
    if aside & {p.name for p in every}:
        warn(f"a start was killed while moving {', '.join(sorted(aside))} aside (a branch left): not resuming from them")
    for i, path in enumerate(done):
        try:
            verify(path, shards=False)
        except CheckpointError as e:  # damaged: fall back to the one before
            warn(f"skipping checkpoint: {e}")
            continue
        check_fits(opts, path, model_meta, architecture)
        refuse_restart_in_place(opts, root, path, every)
        return done[i:]
    if done:
        warn(f"no usable checkpoint in {root}: starting fresh")
    return []


def unknown_owner(path: Path) -> None:
    """The warning for a checkpoint whose ``LINEAGE`` cannot be read as a run's id (none if it has none)."""
    try:
        if not (path / LINEAGE_FILE).exists():
            return
        why = "is damaged (not a run's id)"
    except OSError as e:
        why = f"is unreadable ({e.strerror or e})"
    warn(f"skipping checkpoint: {path / LINEAGE_FILE} {why}: whose checkpoint it is is unknown, so it is left as it is")


def unmarked_newer(root: Path, newest: Path | None, current: str | None) -> None:
    """One line for each step folder newer than ``newest`` (the newest committed candidate) that has
    no ``COMMITTED`` marker: an interrupted save, or a checkpoint whose marker was removed; either way
    it is not resumed from. Only the run's own (``current``) where the folder records one."""
    for p in reversed(step_dirs(root)):
        if newest is not None and p.name <= newest.name:
            break
        if marked(p) or (current is not None and lineage_of(p) != current):
            continue
        warn(f"skipping checkpoint {p}: no {COMMIT_MARKER} marker (a save that was interrupted, or its marker was removed)")


def read_model(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Load the ``model`` part of a committed DCP checkpoint into ``model``'s tensors,
    after checking every file against its checksum, through the safe reader."""
    from core.checkpoint import safe_dcp  # as in Restorer.load_shards

    verify(path)
    check_shapes(path, model)
    sd = model.state_dict()
    safe_dcp.load({"model": sd}, path)
    return sd
