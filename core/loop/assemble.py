"""Building the state a run trains: model, optimizer, schedule, loader and run counters.

The order: the model on the meta device -> precision conversion (e.g. fp8
linears) -> real storage with ties kept, and initialization (then the initial
weights, if any) -> activation checkpointing -> torch.compile per block ->
parallelism wrapper (the last three in :func:`core.loop.parallelize.parallelize`) ->
optimizer and schedule -> loader (read a step ahead in a thread on CUDA,
:mod:`core.data.prefetch`).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.checkpoint import TrainingState, seed_everything
from core.contract import log, mup
from core.contract.errors import ConfigError, PluginError
from core.contract.members import member, returned
from core.contract.param_groups import param_groups
from core.contract.protocols import DistInfo, LoaderSpec, loader_state_per_rank, output_head_params
from core.contract.run import Run
from core.data.prefetch import prefetching
from core.preflight.prepare import Prepared
from core.runtime import distributed
from core.runtime.materialize import materialize


@dataclass
class Assembled:
    """What :func:`assemble` builds: the state a checkpoint holds, and how the loop drives it."""

    state: TrainingState
    train_model: torch.nn.Module  # the model as the parallelism plugin wrapped it
    loader_spec: LoaderSpec


def assemble(prep: Prepared, dist: DistInfo, control: distributed.ControlPlane, initial_load: bool) -> Assembled:
    """The seeded state of a fresh run; ``initial_load``: with the weights of ``checkpoint.initial_load``, if set."""
    rc, c = prep.rc, prep.components
    seed_everything(rc.train.seed)
    spec, precision, parallelism = c["model"], c["precision"], c["parallelism"]
    name = {slot: f"{slot} {chosen.component.name!r}" for slot, chosen in rc.slots.items()}
    with torch.device("meta"):
        model = spec.build()
    model = returned(precision.convert(model, spec), torch.nn.Module, f"{name['precision']}: convert()", "a torch.nn.Module")
    materialize(model, dist.device)  # weight ties kept
    with torch.no_grad():
        spec.init_weights(model)
    initial = rc.sections["checkpoint"].initial_load
    if initial and initial_load:
        from core.weights import copy_into, load_weights

        copy_into(model, load_weights(Path(initial), spec, model))
        if dist.is_main:
            log.info(f"initial weights from {initial}")
    from core.loop.parallelize import parallelize

    train_model = parallelize(model, spec, parallelism, precision, dist, rc.train)
    returned(train_model, torch.nn.Module, f"{name['parallelism']}: wrap()", "a torch.nn.Module")
    if prep.micro_batch_candidates:
        choose_micro_batch(prep, dist, control, model, train_model)
    optimizer = make_optimizer(spec, rc.slots["model"].component.name, model, c["optimizer"])
    returned(optimizer, torch.optim.Optimizer, f"{name['optimizer']}: build()", "a torch.optim.Optimizer")
    total, schedule = prep.total_steps, c["lr_schedule"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule.multiplier(s, total))
    loader_spec = LoaderSpec(
        seq_len=rc.seq_len,
        micro_batch=int(rc.train.micro_batch),  # "auto" was resolved by choose_micro_batch
        grad_accum=prep.grad_accum,
        dp_rank=dist.dp_rank,
        dp_size=dist.dp_size,
        seed=rc.train.seed,
        total_samples=total * rc.train.global_batch_tokens // rc.seq_len,
        vocab_size=spec.vocab_size,
    )
    run = Run(
        config=prep.resolved,
        output_dir=Path(rc.train.output_dir),
        dist=dist,
        total_steps=total,
        tokens_per_step=prep.tokens_per_step,
        model=model,
        spec=spec,
        optimizer=optimizer,
        precision=precision,
        tokenizer=prep.tokenizer,
        state={"wall_time_s": 0.0, "best_val_loss": math.inf},
        log_every=rc.train.log_every,
    )
    # The run's lineage: checkpoints record it, pruning only touches its own; a resume carries it on.
    run.state["lineage"] = control.agree(uuid.uuid4().hex, "root")
    loader = c["data"].loader(loader_spec)
    if not all(callable(member("loader", loader, m)) for m in ("__iter__", "state_dict", "load_state_dict")):
        raise PluginError(f"{name['data']}: loader() returned {type(loader).__name__}; expected an iterable with state_dict() and load_state_dict()")
    if dist.dp_size != dist.world_size and loader_state_per_rank(loader):  # a checkpoint keeps a stream position per rank, not per data-parallel rank
        degree = f"pp = {dist.pp}" if dist.pp > 1 else f"tp = {dist.tp}"
        raise ConfigError(
            f"{name['data']}: a streaming source (a position per rank) with [parallelism] {degree} is not supported yet; "
            "expected a source with a global sample index (token_bin) or tp = pp = 1"
        )
    state = TrainingState(model=model, optimizer=optimizer, scheduler=scheduler, loader=prefetching(loader, prep.grad_accum, dist.device), run=run)
    return Assembled(state=state, train_model=train_model, loader_spec=loader_spec)


def make_optimizer(spec: Any, model_name: str, model: torch.nn.Module, builder: Any) -> Any:
    """The optimizer plugin's optimizer over the core's parameter groups of ``model`` (unwrapped): the
    untied head in a group of its own for an optimizer with ``separate_output_head`` or under µP,
    and µP's LR multiplier per kind (:mod:`core.contract.mup`)."""
    widths = mup.model_widths(spec, model_name)
    separate = member("optimizer", builder, "separate_output_head")
    head = output_head_params(spec, model) if separate or widths else ()
    return builder.build(param_groups(model, builder.options, head, mup.lr_multipliers(widths, builder), head_is_matrix=not separate))


def choose_micro_batch(prep: Prepared, dist: DistInfo, control: distributed.ControlPlane, model: torch.nn.Module, train_model: torch.nn.Module) -> None:
    """``micro_batch = "auto"``: probe on CUDA, agree across ranks, re-derive accumulation."""
    from core.config.sections import batch_layout
    from core.loop.micro_batch import probe

    rc, c = prep.rc, prep.components
    micro: Any = rc.train.micro_batch
    if dist.device.type == "cuda":
        n_params = sum(p.numel() for p in model.parameters())
        state = int(member("optimizer", c["optimizer"], "state_bytes_per_param") * n_params)
        micro = probe(train_model, c["precision"], dist.device, prep.micro_batch_candidates, rc.seq_len, c["model"].vocab_size, state)
        micro = control.agree(micro, "min")  # the smallest rank's answer
    rc.train.micro_batch = micro
    prep.grad_accum = batch_layout(rc.train.global_batch_tokens, micro, rc.seq_len, dist.dp_size)
    if dist.is_main:
        log.info(f'micro_batch = "auto" chose {micro} (accumulation {prep.grad_accum}) on {dist.device}')
