"""Loading a checkpoint into the :class:`core.checkpoint.checkpointer.TrainingState`: the DCP shards
(refused if they hold NaN or inf), then ``state.json``'s parts (step, schedule, data position) and
the RNGs, leaving out ``checkpoint.exclude_from_loading``; this run's optimizer settings win over
the checkpoint's (:mod:`core.checkpoint.hyperparams`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from core.checkpoint import hyperparams
from core.checkpoint.folders import read_json, verify
from core.checkpoint.rng import set_rng_state
from core.contract import log
from core.contract.errors import CheckpointError
from core.contract.protocols import loader_state_per_rank
from core.runtime import watchdog

if TYPE_CHECKING:
    from core.checkpoint.checkpointer import Checkpointer


def load(ck: Checkpointer, path: Path, exclude: frozenset[str] = frozenset()) -> None:
    """Restore the state from ``path`` (its shards already checked by :mod:`core.checkpoint.resume`, or
    saved by this run), leaving out ``checkpoint.exclude_from_loading`` and ``exclude``.
    May fail half-way, leaving the state mixed: the caller builds it afresh then."""
    ck.wait_for_staging()  # an async save may still be copying the state this load overwrites
    watchdog.progress(f"loading the checkpoint {path}")
    skip = set(ck.opts.exclude_from_loading) | set(exclude)
    meta = verify(path, shards=False)
    current_opt = ck.about["optimizer_plugin"]
    if "optimizer" not in skip and meta.get("optimizer_plugin") != current_opt:
        skip.add("optimizer")
        log.warn(
            f"checkpoint {path} holds optimizer state of {meta.get('optimizer_plugin')!r}, "
            f"this run uses {current_opt!r}: loading the weights and starting the optimizer fresh"
        )
    mine = hyperparams.settings(ck.state.optimizer)  # this run's config: it wins over the checkpoint's settings
    load_shards(ck, path, skip)
    changed = hyperparams.reapply(ck.state.optimizer, mine)
    load_json_parts(ck, path, meta, skip, changed)
    ck.last_saved_step = ck.state.run.step
    if ck.dist.is_main:
        hyperparams.say_restored(path, meta, skip, ck.state, ck.dist.world_size)
        hyperparams.say_changes(path, changed)
        hyperparams.seed_changed(path, meta, ck.about["seed"])
        hyperparams.config_changed(path, meta, ck.state.run.config)
        hyperparams.data_changed(path, meta, ck.about.get("data_fingerprint"))


def load_shards(ck: Checkpointer, path: Path, skip: set[str]) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from core.checkpoint import safe_dcp
    from core.checkpoint.finite import count_nonfinite

    model, optimizer = ck.state.model, ck.state.optimizer
    shards: dict[str, Any] = {}
    if "model" not in skip:
        shards["model"] = get_model_state_dict(model)
    if "optimizer" not in skip:
        shards["optimizer"] = get_optimizer_state_dict(model, optimizer)
    if not shards:
        return
    safe_dcp.load(shards, path, ck.group)
    bad = ck.where.agree(count_nonfinite(shards)[0], "sum")
    if bad:
        raise CheckpointError(f"checkpoint {path} holds NaN or inf in {bad} tensor(s); it cannot be trained from")
    if "model" in shards:
        set_model_state_dict(model, shards["model"])
    if "optimizer" in shards:
        set_optimizer_state_dict(model, optimizer, shards["optimizer"])


def load_json_parts(ck: Checkpointer, path: Path, meta: dict[str, Any], skip: set[str], changed: dict[str, Any]) -> None:
    run, scheduler, loader, rank = ck.state.run, ck.state.scheduler, ck.state.loader, ck.dist.rank
    if "train" not in skip:
        run.step = int(meta["step"])
        run.tokens_seen = int(meta["tokens_seen"])
        run.state.update(meta.get("train", {}))
    if "lr_schedule" not in skip:
        sched = scheduler.state_dict()
        peaks = list(sched["base_lrs"])  # this run's config
        sched.update(meta["lr_schedule"])
        scheduler.load_state_dict(sched)
        for group, lr in zip(ck.state.optimizer.param_groups, hyperparams.next_lrs(scheduler, peaks, changed)):
            if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep lr in a tensor
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = float(lr)
    same_world = meta.get("world_size") == ck.dist.world_size
    if "data" not in skip:
        from core.checkpoint.resume import check_data_position

        check_data_position(path, meta, run.config, loader_state_per_rank(loader), rank, ck.dist.world_size)
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
            torch.manual_seed(ck.about["seed"] + run.step * 1000 + rank)
