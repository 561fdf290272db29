"""``python -m core.plan --config F [--nproc N] [--json] [--tokens-per-s X | --measure] [--usd-per-device-hr X] [--section.key=value ...]``

A dry run that needs no process group and allocates no weights: the model is
built on the meta device. It runs every check ``core.train`` runs before
building (options, data files, the checkpoint to resume from, writable output
and checkpoint folders), so bad input exits 2 here too; ``--config-only``
skips the data, checkpoint and folder checks, to plan a run for another
machine. Prints the resolved plugins, parameter counts,
FLOPs per token, the batch layout, the number of steps, the sequence-length
stages, an estimate of memory per rank, and the run's ETA and cost.

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

import json
import math
import sys
from pathlib import Path
from typing import Any

from torch import nn

from core import log
from core.contract import optional
from core.errors import ArgumentParser, ConfigError, PlaitError, exit_bad_input
from preflight.disk import checkpoint_bytes
from tools.measure import measure

GiB = 2**30


def count_params(spec: Any, model: nn.Module) -> tuple[int, int]:
    """(total, non-embedding) parameters of ``model`` (on the meta device); tied weights count once."""
    counts = getattr(spec, "param_counts", None)
    if counts is not None:
        return tuple(counts())  # type: ignore[return-value]
    unique = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in unique.values())
    emb = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return total, total - sum(unique[i].numel() for i in emb if i in unique)


def make_plan(prep) -> dict[str, Any]:
    rc, c = prep.rc, prep.components
    spec = c["model"]
    meta = prep.model_meta
    assert meta is not None  # prepare() builds it for its checks
    total, non_emb = count_params(spec, meta)
    world = prep.world_size
    shards = getattr(c["parallelism"], "shards_parameters", False)
    shard = world if shards else 1
    act_bytes_per_el = 4 if c["precision"].param_dtype is None else 2
    opt_bytes = optional(c["optimizer"], "state_bytes_per_param", 8)
    mem = {
        "weights_gib": total * 4 / shard / GiB,
        "grads_gib": total * 4 / shard / GiB,
        "optimizer_gib": total * opt_bytes / shard / GiB,
        "activations_gib": spec.activation_bytes(rc.train.micro_batch, rc.seq_len, act_bytes_per_el) / GiB,
    }
    mem["total_gib"] = sum(mem.values())
    ckpt_opts = rc.sections["checkpoint"]
    ckpt_gib = checkpoint_bytes(meta, opt_bytes) / GiB  # fp32 weights and the optimizer state, all ranks
    checkpoint = {
        "size_gib": ckpt_gib,
        "every": ckpt_opts.every,
        "async": ckpt_opts.async_save,
        # async saves copy the state each rank writes into host buffers kept for the run (checkpointing/staging.py):
        # its shard under fsdp2, its share of the replicas under ddp and of the repeated shards under HSDP
        # (checkpointing/replicas.py)
        "async_host_gib_per_rank": ckpt_gib / world if ckpt_opts.async_save else 0.0,
        "dir": str(prep.checkpoint_root),  # every rank writes its shards there: on several nodes, one folder they all see
    }
    fpt = spec.flops_per_token(rc.seq_len)
    return {
        "config": prep.source,
        "output_dir": str(rc.train.output_dir),
        "plugins": {chosen.section: chosen.component.name for chosen in rc.slots.values()},
        "monitors": [m.component.name for m in rc.monitors],
        "params_total": total,
        "params_non_embedding": non_emb,
        "flops_per_token": fpt,
        "seq_len": rc.seq_len,
        "world_size": world,
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
    }


def resume_summary(prep) -> dict[str, Any] | None:
    """The checkpoint a start would resume from, its step, and the config values that differ from its own."""
    from checkpointing.folders import STATE_FILE, lineage_of
    from checkpointing.hyperparams import config_differences
    from checkpointing.retention import later_than

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


def checkpoint_line(c: dict[str, Any], world: int) -> str:
    when = f"every {c['every']:,} steps" if c["every"] else "at the end and on a stop"
    host = f"; async: {c['async_host_gib_per_rank']:.2f} GiB of host memory per rank for the run (pinned on CUDA)" if c["async"] else ""
    line = f"  checkpoint  {c['size_gib']:.2f} GiB ({when}, weights + optimizer state){host}, in {c['dir']}"
    if world > 1:  # this plan runs on one node and cannot look at the others
        line += "\n              on several nodes: one folder every node mounts (shared storage); the trainer refuses a disk of each node's own at its start (exit 2)"
    return line


def human(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:g}"


def render(plan: dict[str, Any]) -> str:
    m = plan["memory_per_rank"]
    lines = [
        f"plan for {plan['config']}",
        "  plugins     " + ", ".join(f"{k}={v}" for k, v in plan["plugins"].items()),
        "  monitors    " + ", ".join(plan["monitors"]),
        f"  parameters  {plan['params_total']:,} total, {plan['params_non_embedding']:,} non-embedding",
        f"  FLOPs/token {human(plan['flops_per_token'])} (the model spec's flops_per_token at seq {plan['seq_len']}; docs/metrics.md)",
        f"  batch       {plan['tokens_per_step']:,} tokens/step = {plan['micro_batch']} micro x {plan['seq_len']} seq "
        f"x {plan['world_size']} ranks x {plan['grad_accum']} accumulation",
        f"  steps       {plan['steps']:,} ({human(plan['total_tokens'])} tokens, {plan['total_flops']:.3g} FLOPs)",
        f"  memory/rank {m['total_gib']:.2f} GiB = weights {m['weights_gib']:.2f} + grads {m['grads_gib']:.2f} "
        f"+ optimizer {m['optimizer_gib']:.2f} + activations {m['activations_gib']:.2f} (estimate"
        + (
            f"; micro_batch = 'auto': the largest candidate; on CUDA the trainer probes {', '.join(map(str, plan['micro_batch_candidates']))} and keeps the first that fits)"
            if len(plan["micro_batch_candidates"]) > 1
            else ")"
        ),
        checkpoint_line(plan["checkpoint"], plan["world_size"]),
    ]
    st = plan["seq_len_stages"]
    staged = len(st) > 1
    for i, stage in enumerate(st):
        label = "stages      " if i == 0 else "            "
        lines.append(
            f"  {label}{'from step ' + format(stage['first_step'], ',') + ': ' if staged else ''}seq {stage['seq_len']} "
            f"x micro {stage['micro_batch']}, steps {stage['first_step']:,}-{stage['last_step']:,} "
            f"({stage['steps']:,} steps, {human(stage['tokens'])} tokens)" + ("" if staged else " (one sequence length)")
        )
    resume = plan.get("resume")
    if resume:
        changes = resume["config_changes"]
        lines.append(f"  resume      from {resume['from']} (step {resume['step']:,} of {plan['steps']:,})")
        lines += [f"              config changed since: {c}" for c in changes]
        if resume["sets_aside"]:
            aside = resume["sets_aside"]
            lines.append(f"              a new branch: the {len(aside)} later checkpoint(s), {aside[0]} to {aside[-1]}, move to abandoned/")
    lines += render_time_and_money(plan)
    return "\n".join(lines)


def render_time_and_money(plan: dict[str, Any]) -> list[str]:
    lines = []
    measured = plan.get("measured")
    if measured:
        lines.append(
            f"  measured    {measured['tokens_per_s_per_device']:,.0f} tokens/s on 1 process on this machine "
            f"({measured['device']}): {measured['timed_steps']} steps of {measured['tokens_per_step']:,} tokens "
            f"in {measured['seconds']:.3g} s after {measured['warmup_steps']} warm-up"
        )
        if plan["world_size"] > 1:
            lines.append(
                f"              x {plan['world_size']} ranks (the planned world size) = {plan['tokens_per_s']:,.0f} "
                "tokens/s for the run, assuming perfect scaling across devices"
            )
    tps = plan["tokens_per_s"]
    if tps is None:
        lines.append("  ETA: give --tokens-per-s or --measure (or set [monitors.budget_guard] expected_tokens_per_s)")
    else:
        if not measured:
            lines.append(f"  throughput  {tps:,.6g} tokens/s for the whole run ({plan['tokens_per_s_source']})")
        scaled = " (later stages scaled by FLOPs/token)" if len(plan["seq_len_stages"]) > 1 else ""
        lines.append(f"  ETA: {duration(plan['eta_s'])} for {human(plan['total_tokens'])} tokens at {tps:,.6g} tokens/s{scaled}")
    rate = plan["usd_per_device_hr"]
    if rate is None:
        lines.append("  cost: give --usd-per-device-hr (or set [monitors.budget_guard] rate_usd_per_hr)")
    elif tps is None:
        lines.append(f"  cost: ${rate:,.6g}/device-hr x {plan['devices']} devices: needs the ETA (--tokens-per-s or --measure)")
    else:
        lines.append(
            f"  cost: ${plan['cost_usd']:,.2f} = ${rate:,.6g}/device-hr x {plan['devices']} devices "
            f"x {plan['eta_s'] / 3600:,.2f} h ({plan['usd_per_device_hr_source']})"
        )
    return lines


def duration(seconds: float) -> str:
    """``38.6 h (1 d 14.6 h)``, ``12.0 min``, ``41 s``."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    hours = seconds / 3600
    days = f" ({int(hours // 24)} d {hours % 24:.1f} h)" if hours >= 24 else ""
    return f"{hours:,.1f} h{days}"


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


def eta_seconds(plan: dict[str, Any], tokens_per_s: float) -> float:
    """Seconds to train every stage at ``tokens_per_s`` (the throughput at the first stage's
    sequence length); a stage at another length runs at the same model FLOP/s."""
    st = plan["seq_len_stages"]
    fpt0, seq0 = st[0]["flops_per_token"], st[0]["seq_len"]
    work = sum(s["tokens"] if s["seq_len"] == seq0 else s["tokens"] * s["flops_per_token"] / fpt0 for s in st)
    return work / tokens_per_s


def budget_guard_options(prep) -> Any:
    for chosen in prep.rc.monitors:
        if chosen.component.name == "budget_guard":
            return chosen.options
    return None


def add_time_and_money(
    plan: dict[str, Any], prep, tokens_per_s: float | None, usd_per_device_hr: float | None, measured: dict[str, Any] | None
) -> dict[str, Any]:
    """ETA and cost fields: from the flags, a measurement, or the budget guard's options."""
    guard = budget_guard_options(prep)
    source = None
    if tokens_per_s is not None:
        source = "--tokens-per-s"
    elif measured is not None:
        tokens_per_s = measured["tokens_per_s_per_device"] * plan["world_size"]
        source = "measured" + (f" x {plan['world_size']} ranks (perfect scaling assumed)" if plan["world_size"] > 1 else "")
    elif guard is not None and guard.expected_tokens_per_s > 0:
        tokens_per_s, source = guard.expected_tokens_per_s, "[monitors.budget_guard] expected_tokens_per_s"
    rate_source = None
    if usd_per_device_hr is not None:
        rate_source = "--usd-per-device-hr"
    elif guard is not None and guard.rate_usd_per_hr > 0:
        usd_per_device_hr, rate_source = guard.rate_usd_per_hr, "[monitors.budget_guard] rate_usd_per_hr"
    devices = (guard.gpus if guard is not None and guard.gpus else 0) or plan["world_size"]
    eta = eta_seconds(plan, tokens_per_s) if tokens_per_s else None
    plan.update(
        {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_source": source,
            "measured": measured,
            "eta_s": eta,
            "eta_hours": eta / 3600 if eta is not None else None,
            "usd_per_device_hr": usd_per_device_hr,
            "usd_per_device_hr_source": rate_source,
            "devices": devices,
            "cost_usd": usd_per_device_hr * devices * eta / 3600 if eta is not None and usd_per_device_hr is not None else None,
        }
    )
    return plan


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


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m core.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc", type=int, default=None, help="world size to plan for (default: $WORLD_SIZE or 1)")
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
    args, overrides = parser.parse_known_args(argv)
    if args.nproc is not None and args.nproc < 1:
        parser.error(f"argument --nproc: expected an integer >= 1, got {args.nproc}")
    try:
        from preflight.prepare import prepare

        if args.plot_lr:
            check_plot_path(args.plot_lr)
        prep = prepare(args.config, overrides, world_size=args.nproc, validate_data=not args.config_only, dry_run=True)
        plan = make_plan(prep)
        from checkpointing.ownership import check_run_folders

        check_run_folders([prep.rc.train.output_dir, prep.checkpoint_root])  # is a job writing there now?
        measured = measure(args.config, overrides, args.measure_warmup, args.measure_steps) if args.measure else None
        add_time_and_money(plan, prep, args.tokens_per_s, args.usd_per_device_hr, measured)
    except PlaitError as e:
        exit_bad_input(e)
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    if args.plot_lr:
        plot_lr(prep, args.plot_lr)
        log.info(f"wrote {args.plot_lr}")
    return 0


def lr_values(prep) -> list[float]:
    """The learning rate of every step of the run, as the trainer will set it."""
    schedule = prep.components["lr_schedule"]
    peak = prep.components["optimizer"].options.lr
    total = prep.total_steps
    return [peak * schedule.multiplier(s, total) for s in range(total)]


def check_plot_path(path: str) -> None:
    """``--plot-lr PATH`` can be drawn: matplotlib is installed, knows the suffix, and the folder takes a file."""
    from preflight.start_folders import probe_folder

    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as e:
        raise ConfigError(f"--plot-lr needs matplotlib (pip install 'plait[report]'): {e}") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lower().lstrip(".") not in formats:
        raise ConfigError(f"--plot-lr {path}: expected a file name ending in one of .{', .'.join(sorted(formats))}")
    if Path(path).is_dir():
        raise ConfigError(f"--plot-lr {path}: is a folder, expected a file name")
    probe_folder(Path(path).parent, "--plot-lr folder")


def plot_lr(prep, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = lr_values(prep)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(1, len(values) + 1), values)
    name = prep.rc.slots["lr_schedule"].component.name
    ax.set(xlabel="step", ylabel="learning rate", title=f"{name}: {prep.source}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
