"""``python -m core.plan --config F [--nproc N] [--json] [--tokens-per-s X | --measure] [--usd-per-device-hr X] [--section.key=value ...]``

A dry run that needs no process group and allocates no weights: the model is
built on the meta device. It runs every check ``core.train`` runs before
building (options, data files, the checkpoint to resume from, writable output
and checkpoint folders), so bad input exits 2 here too; ``--config-only``
skips the data, checkpoint and folder checks, to plan a run for another
machine. Prints the resolved plugins, parameter counts,
FLOPs per token, the batch layout, the number of steps, the sequence-length
stages, an estimate of memory per rank, the run's ETA and cost, and what the
in-loop evaluation adds (:mod:`core.cli.plan_eval`).

The ETA needs a throughput (tokens per second of the whole run, all devices
together, as the logged ``tokens_per_s``): ``--tokens-per-s``, else
``--measure`` (a few real training steps of this config timed on this
machine, one process; multiplied by ``--nproc`` when that is above 1, which
assumes perfect scaling), else ``[monitors.budget_guard]
expected_tokens_per_s`` when that monitor is enabled. The throughput is taken
as the one at the first stage's sequence length; later stages (a monitor's
``plait_seq_len_schedule``, such as ``seq_len_stages``) are scaled by their
FLOPs per token (the same model FLOP/s). Cost = USD per device-hour (``--usd-per-device-hr``, else the budget
guard's ``rate_usd_per_hr``) x devices (the budget guard's ``gpus``, else the
world size) x hours.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from core.cli.lr_plot import check_plot_path, plot_lr
from core.cli.measure import measure
from core.cli.plan_eta import add_time_and_money
from core.cli.plan_eval import add_evaluation_cost
from core.cli.plan_render import render
from core.contract import log, mup
from core.contract.errors import EXIT_BAD_INPUT, ArgumentParser, PlaitError, exit_bad_input
from core.contract.members import member
from core.contract.protocols import output_head_params
from core.loop.assemble import make_optimizer
from core.runtime.disk import checkpoint_bytes

GiB = 2**30


def count_params(spec: Any, model: nn.Module) -> tuple[int, int]:
    """(total, non-embedding) parameters of ``model`` (on the meta device), as ``ModelSpec`` defines
    ``param_counts()``: tied weights count once; every ``nn.Embedding``'s and the output head's are not
    non-embedding."""
    counts = member("model", spec, "param_counts")
    if counts is not None:
        return tuple(counts())  # type: ignore[return-value]
    unique = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in unique.values())
    emb = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()} | {id(p) for p in output_head_params(spec, model)}
    return total, total - sum(unique[i].numel() for i in emb if i in unique)


def rank_layout(prep, total: int, bytes_per_element: int, pipeline: dict[str, Any] | None = None) -> dict[str, Any]:
    """The mesh and what one rank holds: ``params_per_rank`` (TP splits all but the model's
    ``whole_params``, FSDP shards the rest over the data-parallel ranks of a shard group; under pp > 1
    the share of the rank with the most, :func:`pipeline_plan`), one step's ``activation_bytes`` kept
    at once (a micro-batch's; under pp > 1 its stages' share, times the micro-batches in flight), and
    TP's ``comm_bytes`` per micro-batch (None: the model does not say); under ep > 1 the experts' share
    (:func:`expert_parallel_layout`)."""
    rc, c = prep.rc, prep.components
    spec, tp, pp, world = c["model"], prep.tensor_parallel, prep.pipeline_parallel, prep.world_size
    dp = world // (tp * pp)
    replicate = getattr(rc.slots["parallelism"].options, "replicate", 1)  # fsdp2's HSDP groups
    shards = member("parallelism", c["parallelism"], "shards_parameters")
    shard = dp // replicate if shards else 1  # ranks one parameter is sharded over
    costs = member("model", spec, "tensor_parallel_costs")
    if tp > 1 and costs is not None:
        got = costs(tp, rc.train.micro_batch, rc.seq_len, bytes_per_element)
    else:
        act = spec.activation_bytes(rc.train.micro_batch, rc.seq_len, bytes_per_element)
        got = {"whole_params": 0, "activation_bytes": act // tp, "comm_bytes": None if tp > 1 else 0}
    whole = got["whole_params"]
    held = (total - whole) / tp + whole  # what one rank of a tp group computes with
    activations = got["activation_bytes"]
    if pipeline is not None:
        held *= pipeline["params_per_rank_max"] / total
        activations = activations * pipeline["block_pass_share"] * pipeline["in_flight_micro_batches"]
    mesh = {"dp": dp, "tp": tp} if replicate == 1 else {"dp": dp, "replicate": replicate, "shard": dp // replicate, "tp": tp}
    if pp > 1:
        mesh = {"pp": pp, **mesh}
    layout = {
        "mesh": mesh,
        "shard": shard,
        "replicate": replicate,
        "params_unsharded": held,
        "params_per_rank": held / shard,
        "activation_bytes": activations,
        "tp_comm_bytes": got["comm_bytes"],
        "expert_params_per_rank": 0.0,
        "ep_comm_bytes": 0,
    }
    return expert_parallel_layout(prep, layout, bytes_per_element, pipeline)


def expert_parallel_layout(prep, layout: dict[str, Any], bytes_per_element: int, pipeline: dict[str, Any] | None = None) -> dict[str, Any]:
    """Under ep > 1 (tp is 1 then): the mesh gains the experts' ``replica x ep`` (the data-parallel ranks
    of a shard group, of each stage under pp); ep splits the experts and FSDP shards each rank's part
    over ``replica`` (HSDP: and repeats it on each ``replicate`` group), so a rank holds ``1 / shard``
    of its stages' experts (``expert_params_per_rank``) and its FSDP shard of every other parameter
    (``params_unsharded``: what the other units gather);
    ``ep_comm_bytes``: the model's all-to-all bytes per micro-batch (None: the model does not say its
    experts, whose parameters are then counted as FSDP-sharded). Under pp, experts and all-to-all are
    the share of the rank with the most layers (of the all-to-all: of block applications)."""
    c = prep.components
    ep = member("parallelism", c["parallelism"], "expert_parallel")
    if ep == 1:
        return layout
    shard = layout["mesh"]["dp"] // layout["replicate"]
    layout["mesh"] = {**layout["mesh"], "replica": shard // ep, "ep": ep}
    costs = member("model", c["model"], "expert_parallel_costs")
    if costs is None:
        layout["ep_comm_bytes"] = None
        return layout
    got = costs(ep, prep.rc.train.micro_batch, prep.rc.seq_len, bytes_per_element)
    share = 1.0 if pipeline is None else pipeline["layers_per_rank"] / max(1, pipeline["layers"])  # of the layers, on this rank
    experts = got["expert_params"] * share
    layout["params_unsharded"] -= experts
    layout["expert_params_per_rank"] = experts / shard
    layout["params_per_rank"] = layout["params_unsharded"] / layout["shard"] + experts / shard
    layout["ep_comm_bytes"] = got["comm_bytes"] * (1.0 if pipeline is None else pipeline["block_pass_share"])  # one all-to-all per block application
    return layout


def communication(prep, layout: dict[str, Any], bytes_per_element: int) -> dict[str, float | None]:
    """GiB one rank sends per optimizer step (ring collectives: (n - 1) / n of the tensor each).
    FSDP: the parameters all-gathered in each micro-batch's forward and again in its backward (once with
    ``reshard_after_forward = false``), the gradients reduce-scattered in fp32 once per step, and under
    HSDP the shards all-reduced across the replicas; DDP: the gradients all-reduced; TP: the model's
    collectives per micro-batch (None: not estimated); PP: the stages' send and receive of activations
    (not estimated); EP: the routed rows' all-to-alls per micro-batch (None: not estimated), and with
    several replicas the experts' FSDP units over them: each rank's ``1 / ep`` of the experts gathered
    as the other units are, their fp32 gradients reduce-scattered (``fsdp_*`` then covers the other
    parameters only), and under HSDP their shards all-reduced over the replicate groups."""
    c, accum = prep.components, prep.grad_accum
    n, shard, replicate = layout["params_unsharded"], layout["shard"], layout["replicate"]
    param_bytes = bytes_per_element
    out: dict[str, float | None] = {}
    gathers = 2 if getattr(prep.rc.slots["parallelism"].options, "reshard_after_forward", True) else 1
    if prep.pipeline_parallel > 1:  # a stage's parameters stay gathered over the step's micro-batches
        gathers, accum = 1, 1
    if member("parallelism", c["parallelism"], "shards_parameters"):
        if shard > 1:
            out["fsdp_all_gather"] = accum * gathers * (shard - 1) / shard * n * param_bytes / GiB
            out["fsdp_reduce_scatter"] = (shard - 1) / shard * n * 4 / GiB
        if replicate > 1:
            out["hsdp_all_reduce"] = 2 * (replicate - 1) / replicate * n / shard * 4 / GiB
    elif layout["mesh"]["dp"] > 1:
        dp = layout["mesh"]["dp"]
        out["ddp_all_reduce"] = 2 * (dp - 1) / dp * n * 4 / GiB
    tp_bytes = layout["tp_comm_bytes"]
    if layout["mesh"]["tp"] > 1:
        out["tp"] = None if tp_bytes is None else prep.grad_accum * tp_bytes / GiB
    if prep.pipeline_parallel > 1:
        out["pp"] = None
    if "ep" in layout["mesh"]:
        ep_bytes, replica = layout["ep_comm_bytes"], layout["mesh"]["replica"]
        out["ep_all_to_all"] = None if ep_bytes is None else prep.grad_accum * ep_bytes / GiB
        if replica > 1 and layout["expert_params_per_rank"]:  # the experts' FSDP units over the replicas
            part = layout["expert_params_per_rank"] * replica  # this rank's 1 / ep of the experts, gathered whole
            out["expert_all_gather"] = accum * gathers * (replica - 1) / replica * part * param_bytes / GiB
            out["expert_reduce_scatter"] = (replica - 1) / replica * part * 4 / GiB
        if replicate > 1 and layout["expert_params_per_rank"]:  # HSDP: the experts' shards over the replicate groups
            out["expert_all_reduce"] = 2 * (replicate - 1) / replicate * layout["expert_params_per_rank"] * 4 / GiB
    return out


def make_plan(prep) -> dict[str, Any]:
    rc, c = prep.rc, prep.components
    spec = c["model"]
    meta = prep.model_meta
    assert meta is not None  # prepare() builds it for its checks
    total, non_emb = count_params(spec, meta)
    world = prep.world_size
    act_bytes_per_el = 4 if c["precision"].param_dtype is None else 2
    opt_bytes = member("optimizer", c["optimizer"], "state_bytes_per_param")
    pipeline = pipeline_plan(prep, spec, meta)
    layout = rank_layout(prep, total, act_bytes_per_el, pipeline)
    mem = {
        "weights_gib": layout["params_per_rank"] * 4 / GiB,
        "grads_gib": layout["params_per_rank"] * 4 / GiB,
        "optimizer_gib": layout["params_per_rank"] * opt_bytes / GiB,
        "activations_gib": layout["activation_bytes"] / GiB,
    }
    mem["total_gib"] = sum(mem.values())
    ckpt_opts = rc.sections["checkpoint"]
    ckpt_gib = checkpoint_bytes(meta, opt_bytes) / GiB  # fp32 weights and the optimizer state, all ranks
    checkpoint = {
        "size_gib": ckpt_gib,
        "every": ckpt_opts.every,
        "async": ckpt_opts.async_save,
        # async saves copy the state each rank writes into host buffers kept for the run (core/checkpoint/staging.py):
        # its shard under fsdp2, its share of the replicas under ddp and of the repeated shards under HSDP
        # (core/checkpoint/replicas.py)
        "async_host_gib_per_rank": ckpt_gib / world if ckpt_opts.async_save else 0.0,
        "dir": str(prep.checkpoint_root),  # every rank writes its shards there: on several nodes, one folder they all see
    }
    fpt = spec.flops_per_token(rc.seq_len)
    return {
        "config": prep.source,
        "output_dir": str(rc.train.output_dir),
        "plugins": {chosen.section: chosen.component.name for chosen in rc.slots.values()},
        "monitors": [m.component.name for m in rc.monitors],
        "options": plugin_options(rc),
        "params_total": total,
        "params_non_embedding": non_emb,
        "flops_per_token": fpt,
        "seq_len": rc.seq_len,
        "world_size": world,
        "mesh": layout["mesh"],  # pipeline stages x data-parallel x tensor-parallel ranks (dp = replicate x shard under HSDP; experts on replica x ep)
        "pipeline": pipeline,
        "communication_per_step_gib": communication(prep, layout, act_bytes_per_el),
        "micro_batch": rc.train.micro_batch,
        "micro_batch_candidates": prep.micro_batch_candidates,  # micro_batch = "auto": the trainer probes down these on CUDA
        "grad_accum": prep.grad_accum,
        "tokens_per_step": prep.tokens_per_step,
        "sequences_per_step": prep.tokens_per_step // rc.seq_len,
        "steps": prep.total_steps,
        "total_tokens": prep.total_steps * prep.tokens_per_step,
        "total_flops": fpt * prep.total_steps * prep.tokens_per_step,
        "memory_per_rank": mem,
        "checkpoint": checkpoint,
        "seq_len_stages": stages(prep),
        "resume": resume_summary(prep),
        "param_groups": param_group_rows(prep, spec),
        "mup_widths": mup.model_widths(spec, rc.slots["model"].component.name),
    }


def pipeline_plan(prep, spec, meta: nn.Module) -> dict[str, Any] | None:
    """Under pp > 1: the stages, the blocks and the parameters of the rank with the most (``v`` times the
    most the model spec's own split, ``pipeline_stages`` on a copy of the meta model, puts on one stage:
    llama3's first stages one more block when they do not divide evenly, recurrent_moe's looped core
    whole, the embedding on the first stage and the head on the last), the
    micro-batches of a step and the pipeline bubble, the idle fraction of a step:
    (p - 1) / (v m + p - 1) for p stages, v stages per rank (1 for 1F1B and GPipe, 2 interleaved) and
    m micro-batches (Narayanan et al. 2021). None without pipeline parallelism."""
    pp = prep.pipeline_parallel
    if pp == 1:
        return None
    v = member("parallelism", prep.components["parallelism"], "pipeline_stages_per_rank")
    schedule = getattr(prep.rc.slots["parallelism"].options, "pipeline_schedule", "1F1B")
    n_stages, m = pp * v, prep.grad_accum
    held = [stage_holds(spec, meta, s, n_stages) for s in range(n_stages)]
    return {
        "stages": n_stages,
        "stages_per_rank": v,
        "layers": len(spec.blocks(meta)),
        "layers_per_rank": max(blocks for blocks, _, _ in held) * v,
        "params_per_rank_max": max(params for _, _, params in held) * v,
        # the rank with the most block applications' share of a micro-batch's (a looped block counts once per loop):
        # of its activations and its all-to-alls
        "block_pass_share": max(passes for _, passes, _ in held) * v / max(1, block_passes(spec, meta)),
        "micro_batches": m,
        # the micro-batches whose activations the first stage keeps at once: all of them under GPipe,
        # at most one per stage under 1F1B (interleaved: about the same, Narayanan et al. 2021)
        "in_flight_micro_batches": m if schedule == "GPipe" else min(m, n_stages),
        "bubble_fraction": (pp - 1) / (v * m + pp - 1),
    }


def stage_holds(spec, meta: nn.Module, stage: int, n_stages: int) -> tuple[int, int, int]:
    """The blocks, their applications in one forward (:func:`block_passes`) and the parameters the model
    spec puts on pipeline stage ``stage`` of ``n_stages`` (its ``pipeline_stages``, which prunes the model
    it is given: a copy of the meta model)."""
    model = copy.deepcopy(meta)
    spec.pipeline_stages(model, [stage], n_stages)
    return len(spec.blocks(model)), block_passes(spec, model), sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def block_passes(spec, model: nn.Module) -> int:
    """The block applications of one forward of ``model`` (the spec's optional ``block_passes``; default: its blocks)."""
    passes = member("model", spec, "block_passes")
    return passes(model) if passes is not None else len(spec.blocks(model))


def param_group_rows(prep, spec) -> list[dict[str, Any]]:
    """The optimizer's parameter groups as the run builds them (over the meta model): name, parameters,
    peak LR (the schedule multiplies it), LR multiplier (µP's and the options' together), weight
    decay and init std (``[lowest, highest]`` over the group's parameters, from
    :func:`init_stds`; None when one of them is set by other means); [] with a note when the
    optimizer cannot be built over meta parameters."""
    rc, c = prep.rc, prep.components
    try:
        optimizer = make_optimizer(c["model"], rc.slots["model"].component.name, prep.model_meta, c["optimizer"])
    except Exception as e:  # e.g. a library that allocates state for each parameter when built
        log.note(f"plan: the optimizer's groups are not listed (it cannot be built over meta parameters: {type(e).__name__}: {e})")
        return []
    stds = init_stds(spec, prep.model_meta)
    return [
        {
            "name": str(g.get("name", i)),
            "params": sum(p.numel() for p in g["params"]),
            "lr": float(g["lr"]),
            "lr_mult": float(g.get("lr_mult", 1.0)),
            "weight_decay": float(g.get("weight_decay", 0.0)),
            "init_std": std_range([stds.get(id(p)) for p in g["params"]]),
        }
        for i, g in enumerate(optimizer.param_groups)
    ]


class _InitRecorder(TorchFunctionMode):
    """Records the std the last in-place init op gave each tensor: ``normal_`` its std,
    ``uniform_(a, b)`` (b - a) / sqrt(12), ``fill_``/``zero_`` 0; any other in-place op None."""

    def __init__(self) -> None:
        super().__init__()
        self.std: dict[int, float | None] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensor = args[0] if args else kwargs.get("tensor")  # Tensor.normal_(t, ...) or nn.init.normal_(tensor=t, ...)
        if name.endswith("_") and not name.startswith("_") and isinstance(tensor, torch.Tensor):
            self.std[id(tensor)] = _std_of(name, args[1:], kwargs)
        return func(*args, **kwargs)


def _std_of(name: str, args: tuple, kwargs: dict[str, Any]) -> float | None:
    """The std an in-place op named ``name`` gives its tensor (positional ``args`` after the tensor)."""
    if name == "normal_":
        return float(args[1] if len(args) > 1 else kwargs.get("std", 1.0))
    if name == "uniform_":
        low = args[0] if args else kwargs.get("a", kwargs.get("from", 0.0))
        high = args[1] if len(args) > 1 else kwargs.get("b", kwargs.get("to", 1.0))
        return (float(high) - float(low)) / math.sqrt(12)
    if name in ("fill_", "zero_", "zeros_", "ones_", "constant_"):
        return 0.0
    return None


def init_stds(spec, model_meta: nn.Module) -> dict[int, float | None]:
    """The init std of each parameter (by id) that ``spec.init_weights`` gives, read off the in-place
    ops it runs on the meta model (no values are allocated); a parameter it does not touch: absent."""
    recorder = _InitRecorder()
    try:
        with torch.no_grad(), recorder:
            spec.init_weights(model_meta)
    except Exception as e:  # a model whose init needs real values
        log.note(f"plan: init stds are not listed (the model's init_weights does not run on meta parameters: {type(e).__name__}: {e})")
        return {}
    return recorder.std


def std_range(stds: list[float | None]) -> list[float] | None:
    """``[lowest, highest]`` of a group's init stds; None when one is unknown (or the group is empty)."""
    if not stds or any(s is None for s in stds):
        return None
    known = [float(s) for s in stds if s is not None]
    return [min(known), max(known)]


def plugin_options(rc) -> dict[str, dict[str, Any]]:
    """The resolved options of each plugin the run uses, by its section: ``[model]``, ...,
    ``[monitors.<name>]`` (the values ``config.resolved.toml`` records)."""
    resolved = rc.to_dict()
    out = {chosen.section: {k: v for k, v in resolved[chosen.section].items() if k != "name"} for chosen in rc.slots.values()}
    out.update({f"monitors.{m.component.name}": resolved["monitors"][m.component.name] for m in rc.monitors})
    return out


def resume_summary(prep) -> dict[str, Any] | None:
    """The checkpoint a start would resume from, its step, and the config values that differ from its own."""
    from core.checkpoint import STATE_FILE, config_differences, later_than, lineage_of

    path = prep.resume_from
    if path is None:
        return None
    meta = json.loads((path / STATE_FILE).read_text())
    excluded = "train" in prep.rc.sections["checkpoint"].exclude_from_loading  # a new lineage: nothing is left behind
    later = [] if excluded else later_than(prep.checkpoint_root, lineage_of(path), path, int(meta["step"]))
    return {
        "from": str(path),
        "step": int(meta["step"]),
        "config_changes": config_differences(meta.get("config") or {}, prep.resolved),
        "sets_aside": [p.name for p in later],  # a new branch: moved to <dir>/abandoned/ at the start
    }


def stages(prep) -> list[dict[str, Any]]:
    """The sequence lengths as the trainer runs them (``prep.seq_len_schedule``): a stage covers
    the 0-based steps from its first step to the next stage's; each keeps the tokens per
    micro-batch, so its micro-batch is ``train.micro_batch x data.seq_len / seq_len``. Without a
    schedule, one stage at ``data.seq_len``."""
    rc, spec, total = prep.rc, prep.components["model"], prep.total_steps
    table = [(0, rc.seq_len), *prep.seq_len_schedule]
    table = [entry for i, entry in enumerate(table) if i + 1 == len(table) or table[i + 1][0] > entry[0]]  # drop empty ones
    firsts = [first for first, _ in table] + [total]
    out = []
    for i, (first, seq) in enumerate(table):
        steps = max(0, firsts[i + 1] - first)
        out.append(
            {
                "seq_len": int(seq),
                "micro_batch": rc.train.micro_batch * rc.seq_len // seq,
                "first_step": first + 1,  # 1-based, as logged
                "last_step": first + steps,
                "steps": steps,
                "tokens": steps * prep.tokens_per_step,
                "flops_per_token": spec.flops_per_token(seq),
            }
        )
    return out


def _number(kind: str, minimum: float, inclusive: bool, integer: bool = False):
    """An argparse type: a finite number above (or at) ``minimum``; anything else is one error line."""

    def parse(text: str):
        import argparse

        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}")
        return value

    return parse


def parser() -> ArgumentParser:
    """The command's flags (docs' flag tables are generated from it: core.cli.doc_tables)."""
    parser = ArgumentParser(prog="python -m core.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, metavar="F", help="the run's TOML file; further --section.key=value flags override its values")
    parser.add_argument("--nproc", type=int, default=None, help="world size to plan for (default: $WORLD_SIZE or 1)")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="K", help="ranks per node, which tp must divide (default: --nproc, one node)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="check the config alone: skip the data files, the checkpoint to resume from and the output folders (to plan a run for another machine)",
    )
    parser.add_argument("--plot-lr", metavar="PNG", help="draw the run's learning-rate schedule to this file (matplotlib)")
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument(
        "--tokens-per-s",
        type=_number("a finite number > 0", 0, False),
        metavar="X",
        help="throughput of the whole run, all devices together, at data.seq_len, for the ETA "
        "(default: [monitors.budget_guard] expected_tokens_per_s when that monitor is enabled)",
    )
    speed.add_argument(
        "--measure",
        action="store_true",
        help="time a few real training steps of this config on this machine (one process) for the ETA; "
        "with --nproc N > 1 the result is multiplied by N (perfect scaling assumed)",
    )
    parser.add_argument(
        "--measure-steps", type=_number("an integer >= 1", 1, True, integer=True), default=3, metavar="N", help="with --measure: timed steps (default 3)"
    )
    parser.add_argument(
        "--measure-warmup",
        type=_number("an integer >= 0", 0, True, integer=True),
        default=2,
        metavar="N",
        help="with --measure: untimed warm-up steps first (default 2)",
    )
    parser.add_argument(
        "--usd-per-device-hr",
        type=_number("a finite number >= 0", 0, True),
        metavar="X",
        help="price of one device-hour for the cost (default: [monitors.budget_guard] rate_usd_per_hr)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    flags = parser()
    args, overrides = flags.parse_known_args(argv)
    if args.nproc is not None and args.nproc < 1:
        flags.error(f"argument --nproc: expected an integer >= 1, got {args.nproc}")
    if args.nproc_per_node is not None and not 1 <= args.nproc_per_node <= (args.nproc or 1):
        flags.error(f"argument --nproc-per-node: expected an integer from 1 to --nproc, got {args.nproc_per_node}")
    problems: list[PlaitError] = []  # missing or unusable data and checkpoints: listed under the plan
    try:
        from core.preflight.prepare import prepare

        if args.plot_lr:
            check_plot_path(args.plot_lr)
        prep = prepare(
            args.config, overrides, world_size=args.nproc, validate_data=not args.config_only, dry_run=True, problems=problems, node_size=args.nproc_per_node
        )
        plan = make_plan(prep)
        from core.runtime.ownership import check_run_folders

        check_run_folders([prep.rc.train.output_dir, prep.checkpoint_root])  # is a job writing there now?
        if args.measure and problems:
            problems.append(PlaitError("--measure: not measured, the problems above stop a start"))
        measured = measure(args.config, overrides, args.measure_warmup, args.measure_steps) if args.measure and not problems else None
        add_time_and_money(plan, prep, args.tokens_per_s, args.usd_per_device_hr, measured)
        add_evaluation_cost(plan, prep)
    except PlaitError as e:
        exit_bad_input(e)
    plan["problems"] = [str(e) for e in problems]
    print(json.dumps(plan, indent=2) if args.json else render(plan), flush=True)
    if args.plot_lr:
        plot_lr(prep, args.plot_lr)
        log.info(f"wrote {args.plot_lr}")
    for problem in problems:  # each on its own line, as a refusal would say it
        print(f"plait: error: {problem}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT if problems else 0


if __name__ == "__main__":
    sys.exit(main())
