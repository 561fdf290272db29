"""What a save writes, made from the :class:`core.checkpoint.checkpointer.TrainingState`, and the
checks it passes before anything is written: the DCP state (model and optimizer) and this rank's
share of it, ``state.json``'s contents, ``run.state`` being JSON, and no NaN or inf."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from core.checkpoint import replicas
from core.checkpoint.folders import CHECKPOINT_FORMAT, plain
from core.contract import log
from core.contract.errors import EXIT_BAD_INPUT, PluginError
from core.contract.protocols import loader_state_per_rank

if TYPE_CHECKING:
    from core.checkpoint.checkpointer import Checkpointer


def dcp_state(ck: Checkpointer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        "model": get_model_state_dict(ck.state.model),
        "optimizer": get_optimizer_state_dict(ck.state.model, ck.state.optimizer),
    }


def written_share(ck: Checkpointer, state: dict[str, Any]) -> dict[str, Any]:
    """This rank's share of ``state`` (:mod:`core.checkpoint.replicas`): every DTensor shard it
    holds and the replicated tensors it writes, so that an async save copies only those. If
    the ranks do not see the same replicated tensors, each passes all of them and DCP picks."""
    if ck.group is None:
        return state
    mine = replicas.agreed_share(state, ck.dist.rank, ck.dist.world_size, ck.where.agree)
    if mine is None:
        if not ck.mixed_replicas_said:
            ck.mixed_replicas_said = True
            log.warn("the ranks' replicated model/optimizer tensors differ in names, shapes or dtypes; every rank copies all of them for a save")
        return state
    return mine


def json_state(ck: Checkpointer, train_loss: float | None) -> dict[str, Any]:
    run = ck.state.run
    sched = {k: plain(v) for k, v in ck.state.scheduler.state_dict().items() if k != "lr_lambdas"}
    return {
        "format": CHECKPOINT_FORMAT,
        "step": run.step,
        "tokens_seen": run.tokens_seen,
        "train": dict(run.state),  # JSON values only (check_run_state)
        "lr_schedule": sched,
        "data": {} if loader_state_per_rank(ck.state.loader) else ck.state.loader.state_dict(),
        "optimizer_plugin": ck.about["optimizer_plugin"],
        "world_size": ck.dist.world_size,
        "config": run.config,
        "versions": ck.about["versions"],
        "data_fingerprint": ck.about.get("data_fingerprint"),
        "architecture": ck.about.get("architecture"),  # resolved architecture values (core.checkpoint.architecture)
        "tokenizer": ck.about.get("tokenizer"),  # the data source's declared tokenizer (core.data.tokenizer_spec)
        "train_loss": train_loss,  # mean over the steps since the previous save (retention)
        "saved_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def check_run_state(ck: Checkpointer) -> None:
    """Rank 0's ``run.state`` (the one a checkpoint saves) must be JSON: a monitor's set or tensor
    there would be a TypeError mid-save (restarted by launchers into the same crash) or, at the top
    level, left out of the checkpoint. So every rank stops, exit 2, and rank 0 names the key, before
    anything of this save is written."""
    why = None
    for key, value in ck.state.run.state.items() if ck.dist.is_main else ():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            why = f"run.state[{key!r}] is not a JSON value ({e}); a monitor keeps only JSON values there (numbers, strings, lists, dicts): every checkpoint saves them"
            break
    if ck.where.agree(int(why is not None), "sum"):
        if why is not None:
            raise PluginError(why)
        raise SystemExit(EXIT_BAD_INPUT)  # rank 0 says why, once


def check_finite(ck: Checkpointer, step: int, state: dict[str, Any]) -> None:
    """Refuse to write NaN or inf: raise NonFiniteState (on every rank) if any shard holds one."""
    from core.checkpoint.finite import count_nonfinite
    from core.loop.nonfinite import NonFiniteState

    bad, total = count_nonfinite(state)
    bad, total = ck.where.agree(bad, "sum"), ck.where.agree(total, "sum")
    if bad:
        done = ck.where.own(ck.lineage)
        last = f"the last checkpoint, {done[-1]}, is kept" if done else "no checkpoint of this run exists yet"
        raise NonFiniteState(f"step {step}: {bad} of {total} model/optimizer tensors hold NaN or inf; not writing a checkpoint from them ({last})")
