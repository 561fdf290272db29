"""The plan of ``python -m core.plan`` as text: plugins, parameters, FLOPs per token, the batch
layout, steps, memory per rank, the checkpoint, the sequence-length stages, the checkpoint a start
resumes from, the measured throughput, ETA and cost (``--json`` prints the same plan unrendered)."""

from __future__ import annotations

from typing import Any

from core.config.sections import data_ranks


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
        f"x {data_ranks(plan['mesh']['dp'], plan['world_size'], plan['mesh']['tp'], plan['mesh'].get('pp', 1))} x {plan['grad_accum']} accumulation",
        f"  steps       {plan['steps']:,} ({human(plan['total_tokens'])} tokens, {plan['total_flops']:.3g} FLOPs)",
        f"  memory/rank {m['total_gib']:.2f} GiB = weights {m['weights_gib']:.2f} + grads {m['grads_gib']:.2f} "
        f"+ optimizer {m['optimizer_gib']:.2f} + activations {m['activations_gib']:.2f} (estimate"
        + (
            f"; micro_batch = 'auto': the largest candidate; on CUDA the trainer probes {', '.join(map(str, plan['micro_batch_candidates']))} and keeps the first that fits)"
            if len(plan["micro_batch_candidates"]) > 1
            else ")"
        ),
        *layout_lines(plan),
        checkpoint_line(plan["checkpoint"], plan["world_size"]),
        *pipeline_lines(plan.get("pipeline")),
        *param_group_lines(plan),
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
    lines += render_evaluation(plan.get("evaluation"))
    lines += render_options(plan["options"])
    problems = plan.get("problems") or []
    lines += [f"  {'problems    ' if i == 0 else '            '}{p}" for i, p in enumerate(problems)]
    if problems:
        lines.append(f"  {len(problems)} problem(s) found: a start with this config is refused (exit code 2) until they are fixed")
    return "\n".join(lines)


def pipeline_lines(p: dict[str, Any] | None) -> list[str]:
    if p is None:
        return []
    return [
        f"  pipeline    {p['stages']} stages ({p['stages_per_rank']} per rank): {p['layers_per_rank']} of {p['layers']} layers per rank, "
        f"at most {p['params_per_rank_max']:,} parameters; {p['micro_batches']} micro-batches ({p['in_flight_micro_batches']} in flight), "
        f"bubble {p['bubble_fraction']:.1%} of a step"
    ]


def layout_lines(plan: dict[str, Any]) -> list[str]:
    """The device mesh and what one rank sends per step (GiB, estimate; core.cli.plan.communication)."""
    if plan["world_size"] == 1:
        return []
    shown = {name: size for name, size in plan["mesh"].items() if name not in ("replica", "ep") and (name != "dp" or "shard" not in plan["mesh"])}
    mesh = " x ".join(f"{name} {size}" for name, size in shown.items())
    if "ep" in plan["mesh"]:
        mesh += f", experts on replica {plan['mesh']['replica']} x ep {plan['mesh']['ep']}"
    names = {
        "fsdp_all_gather": "FSDP all-gather",
        "fsdp_reduce_scatter": "reduce-scatter",
        "hsdp_all_reduce": "HSDP all-reduce",
        "ddp_all_reduce": "DDP all-reduce",
        "tp": "TP",
        "pp": "PP send/recv",
        "ep_all_to_all": "EP all-to-all",
        "expert_all_gather": "experts' all-gather",
        "expert_reduce_scatter": "experts' reduce-scatter",
        "expert_all_reduce": "experts' HSDP all-reduce",
    }
    comm = plan["communication_per_step_gib"]
    parts = [f"{names[k]} {'not estimated' if v is None else f'{v:.3g}'}" for k, v in comm.items()]
    return [f"  mesh        {mesh}", f"  comm/step   {', '.join(parts) or 'none'} GiB sent per rank (estimate, ring collectives)"]


def param_group_lines(plan: dict[str, Any]) -> list[str]:
    """One line per optimizer group: its peak LR (multiplier), init std, weight decay and parameters; the µP widths."""
    lines = []
    widths = plan.get("mup_widths")
    if widths:
        width, base = widths
        lines.append(f"  µP          width {width}, base width {base}: logits x {base / width:.4g}, per-kind LR multipliers below (docs/mup.md)")
    for i, g in enumerate(plan.get("param_groups", [])):
        label = "LR groups   " if i == 0 else "            "
        lines.append(
            f"  {label}{g['name']}: peak lr {g['lr']:.4g} (x {g['lr_mult']:.4g}), init std {init_std_text(g.get('init_std'))}, "
            f"weight_decay {g['weight_decay']:g}, {g['params']:,} params"
        )
    return lines


def init_std_text(stds: list[float] | None) -> str:
    """``0.02``, or ``0.0221-0.0625`` when the group's parameters differ, ``0 (constant)``, ``unknown``."""
    if not stds:
        return "unknown"
    low, high = stds
    if high == 0:
        return "0 (constant)"
    return f"{low:.4g}" if low == high else f"{low:.4g}-{high:.4g}"


def render_options(options: dict[str, dict[str, Any]]) -> list[str]:
    """Each plugin's resolved options, one line per section: ``[optimizer] lr=0.0003, ...``."""
    lines = []
    for i, (section, values) in enumerate(options.items()):
        label = "options     " if i == 0 else "            "
        lines.append(f"  {label}[{section}] " + (", ".join(f"{k}={v!r}" for k, v in values.items()) or "(none)"))
    return lines


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


def render_evaluation(ev: dict[str, Any] | None) -> list[str]:
    """One line per in-loop evaluation (a pass's forward tokens, FLOPs and seconds; passes in the run), then the total."""
    if not ev or not ev["passes"]:
        return []
    lines = []
    for i, r in enumerate(ev["passes"]):
        label = "evaluation  " if i == 0 else "            "
        head = f"  {label}{r['name']} every {r['every']:,} steps and at the end: {r['passes']:,} passes"
        if "unknown" in r:
            lines.append(f"{head}; cost unknown: {r['unknown']}")
            continue
        per = f", {duration(r['seconds_per_pass'])} each" if r["seconds_per_pass"] is not None else ""
        lines.append(
            f"{head} of {r['items']:,} items, {r['requests']:,} sequences, {human(r['forward_tokens'])} forward tokens "
            f"({r['forwards']:,} forwards, padded), {r['flops_per_pass']:.3g} FLOPs{per}"
        )
    if len(ev["unknown"]) == len(ev["passes"]):
        return lines
    share = ev["fraction_of_training"] or 0.0
    total = f"{duration(ev['seconds'])}, " if ev["seconds"] is not None else ""
    unknown = f"; {', '.join(ev['unknown'])} not counted (unknown)" if ev["unknown"] else ""
    lines.append(
        f"              all passes: {total}{ev['flops']:.3g} FLOPs = {100 * share:.3g}% of the training FLOPs and time "
        f"(a forward token at 1/3 of a training token's FLOPs, at the training FLOP/s: an estimate){unknown}"
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
