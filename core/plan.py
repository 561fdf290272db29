"""``python -m core.plan --config F [--nproc N] [--json] [--section.key=value ...]``

A dry run that needs no process group and allocates no weights: the model is
built on the meta device. It runs every check ``core.train`` runs before
building (options, data files, the checkpoint to resume from, writable output
and checkpoint folders), so bad input exits 2 here too; ``--config-only``
skips the data, checkpoint and folder checks, to plan a run for another
machine. Prints the resolved plugins, parameter counts,
FLOPs per token, the batch layout, the number of steps and an estimate of
memory per rank.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch import nn

from core.errors import ArgumentParser, PlaitError, exit_bad_input

GiB = 2**30


def count_params(spec: Any) -> tuple[int, int]:
    """(total, non-embedding) parameters; tied weights count once."""
    counts = getattr(spec, "param_counts", None)
    if counts is not None:
        return tuple(counts())  # type: ignore[return-value]
    with torch.device("meta"):
        model = spec.build()
    unique = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in unique.values())
    emb = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return total, total - sum(unique[i].numel() for i in emb if i in unique)


def make_plan(prep) -> dict[str, Any]:
    rc, c = prep.rc, prep.components
    spec = c["model"]
    total, non_emb = count_params(spec)
    world = prep.world_size
    shards = getattr(c["parallelism"], "shards_parameters", False)
    shard = world if shards else 1
    act_bytes_per_el = 4 if c["precision"].param_dtype is None else 2
    opt_bytes = getattr(c["optimizer"], "state_bytes_per_param", 8)
    mem = {
        "weights_gib": total * 4 / shard / GiB,
        "grads_gib": total * 4 / shard / GiB,
        "optimizer_gib": total * opt_bytes / shard / GiB,
        "activations_gib": spec.activation_bytes(rc.train.micro_batch, rc.seq_len, act_bytes_per_el) / GiB,
    }
    mem["total_gib"] = sum(mem.values())
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
        "grad_accum": prep.grad_accum,
        "tokens_per_step": prep.tokens_per_step,
        "sequences_per_step": prep.tokens_per_step // rc.seq_len,
        "steps": prep.total_steps,
        "total_tokens": prep.total_steps * prep.tokens_per_step,
        "total_flops": fpt * prep.total_steps * prep.tokens_per_step,
        "memory_per_rank": mem,
    }


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
        f"  FLOPs/token {human(plan['flops_per_token'])} (6 x matmul params incl. the output head + 12 x layers x d x seq)",
        f"  batch       {plan['tokens_per_step']:,} tokens/step = {plan['micro_batch']} micro x {plan['seq_len']} seq "
        f"x {plan['world_size']} ranks x {plan['grad_accum']} accumulation",
        f"  steps       {plan['steps']:,} ({human(plan['total_tokens'])} tokens, {plan['total_flops']:.3g} FLOPs)",
        f"  memory/rank {m['total_gib']:.2f} GiB = weights {m['weights_gib']:.2f} + grads {m['grads_gib']:.2f} "
        f"+ optimizer {m['optimizer_gib']:.2f} + activations {m['activations_gib']:.2f} (estimate)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m core.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc", type=int, default=None, help="world size to plan for (default: $WORLD_SIZE or 1)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--config-only", action="store_true",
                        help="check the config alone: skip the data files, the checkpoint to resume from and the "
                             "output folders (to plan a run for another machine)")
    parser.add_argument("--plot-lr", metavar="PNG", help="draw the run's learning-rate schedule to this file (matplotlib)")
    args, overrides = parser.parse_known_args(argv)
    try:
        from core.prepare import prepare

        prep = prepare(args.config, overrides, world_size=args.nproc, validate_data=not args.config_only, dry_run=True)
        plan = make_plan(prep)
        from core.ownership import check_run_folders

        check_run_folders([prep.rc.train.output_dir, prep.checkpoint_root])  # is a job writing there now?
    except PlaitError as e:
        exit_bad_input(e)
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    if args.plot_lr:
        plot_lr(prep, args.plot_lr)
        print(f"wrote {args.plot_lr}")
    return 0


def lr_values(prep) -> list[float]:
    """The learning rate of every step of the run, as the trainer will set it."""
    schedule = prep.components["lr_schedule"]
    peak = prep.components["optimizer"].options.lr
    total = prep.total_steps
    return [peak * schedule.multiplier(s, total) for s in range(total)]


def plot_lr(prep, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"plait: error: --plot-lr needs matplotlib (pip install 'plait[report]'): {e}")
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
