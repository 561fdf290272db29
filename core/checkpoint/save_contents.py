"""What a save writes, made from a :class:`core.checkpoint.training_state.TrainingState`, and the
checks it passes before anything is written: :class:`SaveContents`."""

from __future__ import annotations

import json
import time
from typing import Any

from core.checkpoint import replicas
from core.checkpoint.checkpoint_dir import CheckpointDir
from core.checkpoint.folders import CHECKPOINT_FORMAT, plain
from core.checkpoint.training_state import TrainingState
from core.contract import log
from core.contract.errors import EXIT_BAD_INPUT, PluginError
from core.contract.protocols import loader_state_per_rank


class SaveContents:
    """What a save of ``state`` writes on the ranks of ``where``: the DCP state (model and optimizer)
    and this rank's share of it, ``state.json``'s contents (``about``: the facts written beside the
    state: ``optimizer_plugin``, ``versions``, ``data_fingerprint``, ``architecture``, ``tokenizer``),
    and the checks a save passes first: ``run.state`` holds JSON values, no tensor holds NaN or inf."""

    def __init__(self, where: CheckpointDir, state: TrainingState, about: dict[str, Any]) -> None:
        self.where, self.state, self.about = where, state, about
        self.mixed_replicas_said = False  # the warning that the ranks' replicated tensors differ, given once

    def dcp_state(self) -> dict[str, Any]:
        """The model's and optimizer's state dicts, as DCP saves them (full, unsharded names)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return {
            "model": get_model_state_dict(self.state.model),
            "optimizer": get_optimizer_state_dict(self.state.model, self.state.optimizer),
        }

    def written_share(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's share of ``state`` (:mod:`core.checkpoint.replicas`): every DTensor shard it
        holds and the replicated tensors it writes, so that an async save copies only those. If
        the ranks do not see the same replicated tensors, each passes all of them and DCP picks."""
        if self.where.group is None:
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
            "architecture": about.get("architecture"),  # resolved architecture values (core.checkpoint.architecture)
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
        from core.checkpoint.finite import NonFiniteState, count_nonfinite

        bad, total = count_nonfinite(state)
        bad, total = self.where.agree(bad, "sum"), self.where.agree(total, "sum")
        if bad:
            done = self.where.own(self.state.lineage)
            last = f"the last checkpoint, {done[-1]}, is kept" if done else "no checkpoint of this run exists yet"
            raise NonFiniteState(f"step {step}: {bad} of {total} model/optimizer tensors hold NaN or inf; not writing a checkpoint from them ({last})")
