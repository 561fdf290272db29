"""Loading a checkpoint into a :class:`core.checkpoint.training_state.TrainingState`:
:class:`Restorer`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from core.checkpoint import hyperparams
from core.checkpoint.checkpoint_dir import CheckpointDir
from core.checkpoint.folders import read_json, verify
from core.checkpoint.rng import set_rng_state
from core.checkpoint.training_state import TrainingState
from core.contract import log
from core.contract.errors import CheckpointError
from core.contract.protocols import loader_state_per_rank
from core.runtime import watchdog


class Restorer:
    """Loads a checkpoint into ``state`` on the ranks of ``where``: the DCP shards (refused if they
    hold NaN or inf), then ``state.json``'s parts (step, schedule, data position) and the RNGs; this
    run's optimizer settings win over the checkpoint's (:mod:`core.checkpoint.hyperparams`).
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
        mine = hyperparams.settings(self.state.optimizer)  # this run's config: it wins over the checkpoint's settings
        self.load_shards(path, skip)
        changed = hyperparams.reapply(self.state.optimizer, mine)
        self.load_json_parts(path, meta, skip, changed)
        if self.where.dist.is_main:
            hyperparams.say_restored(path, meta, skip, self.state, self.where.dist.world_size)
            hyperparams.say_changes(path, changed)
            hyperparams.seed_changed(path, meta, self.about["seed"])
            hyperparams.config_changed(path, meta, self.state.run.config)
            hyperparams.data_changed(path, meta, self.about.get("data_fingerprint"))

    def load_shards(self, path: Path, skip: set[str]) -> None:
        """The model's and optimizer's DCP shards, unless ``skip`` names them; NaN or inf in them is refused."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from core.checkpoint import safe_dcp
        from core.checkpoint.finite import count_nonfinite

        model, optimizer = self.state.model, self.state.optimizer
        shards: dict[str, Any] = {}
        if "model" not in skip:
            shards["model"] = get_model_state_dict(model)
        if "optimizer" not in skip:
            shards["optimizer"] = get_optimizer_state_dict(model, optimizer)
        if not shards:
            return
        safe_dcp.load(shards, path, self.where.group)
        bad = self.where.agree(count_nonfinite(shards)[0], "sum")
        if bad:
            raise CheckpointError(f"checkpoint {path} holds NaN or inf in {bad} tensor(s); it cannot be trained from")
        if "model" in shards:
            set_model_state_dict(model, shards["model"])
        if "optimizer" in shards:
            set_optimizer_state_dict(model, optimizer, shards["optimizer"])

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
            for group, lr in zip(self.state.optimizer.param_groups, hyperparams.next_lrs(scheduler, peaks, changed)):
                if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep lr in a tensor
                    group["lr"].fill_(float(lr))
                else:
                    group["lr"] = float(lr)
        same_world = meta.get("world_size") == self.where.dist.world_size
        if "data" not in skip:
            from core.checkpoint.resume import check_data_position

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
