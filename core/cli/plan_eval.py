"""A plan's evaluation cost: what the in-loop evaluation (each monitor's ``plait_planned_evaluation``,
such as ``downstream``'s, and ``[validation]``) adds to the run.

Per evaluation: the forward tokens of one pass (padding included, as the scorer batches them), its
FLOPs (a forward token costs a third of the model's training FLOPs per token at the forward's
width: ``flops_per_token(width) / 3``), the passes in the run (every ``every`` steps and at the
final step), and, with a throughput, its seconds at the run's model FLOP/s (the ETA's). The share
of the run is the passes' FLOPs over the training steps' FLOPs (the stages', each at its own
length): the time they add at the same FLOP/s. An estimate: eval forwards (other shapes, no
backward) may run at another FLOP/s than the step (docs/benchmarks.md#eval-vs-step measures both).
A monitor whose files are not readable here is listed as unknown, never guessed.
"""

from __future__ import annotations

from typing import Any

from core.contract.errors import PluginError
from core.loop.evaluation import PassCost
from core.preflight.plugin_checks import call_plugin


def passes_in(steps: int, every: int) -> int:
    """Passes in a run of ``steps`` steps: at each multiple of ``every`` and at the final step."""
    return steps // every + (1 if steps % every else 0) if every > 0 and steps > 0 else 0


def forward_flops(cost: PassCost, flops_per_token: Any) -> float:
    """FLOPs of one pass: each forward's tokens at a third of the training FLOPs per token at its width."""
    return sum(rows * width * flops_per_token(width) / 3 for rows, width in cost.forwards)


def validation_cost(prep) -> PassCost | None:
    """``[validation]``'s pass over all ranks: ``batches`` micro-batches on each data-parallel rank; None when disabled."""
    rc, val = prep.rc, prep.rc.sections["validation"]
    if not val.every:
        return None
    micro_batches = val.batches * (prep.world_size // prep.tensor_parallel)
    return PassCost(micro_batches, micro_batches * rc.train.micro_batch, ((rc.train.micro_batch, rc.seq_len),) * micro_batches)


def planned(prep) -> list[tuple[str, dict[str, Any]]]:
    """(name, answer) of each evaluation the run does: the monitors' answers, then ``validation``."""
    out: list[tuple[str, dict[str, Any]]] = []
    hooks = prep.monitor_hooks
    if hooks is not None:
        for impl in hooks.hook.plait_planned_evaluation.get_hookimpls():  # config order
            what = f"monitor {impl.plugin_name!r}: plait_planned_evaluation"
            answer = call_plugin(what, impl.function)
            if answer is None:
                continue
            shaped = isinstance(answer, dict) and isinstance(answer.get("every"), int) and answer["every"] >= 1
            if not shaped or not isinstance(answer.get("cost"), (PassCost, type(None))):
                raise PluginError(f"{what} returned {answer!r}; expected {{'every': an integer >= 1, 'cost': a PassCost or None, 'why': str}} or None")
            out.append((impl.plugin_name, answer))
    val = validation_cost(prep)
    if val is not None:
        out.append(("validation", {"every": prep.rc.sections["validation"].every, "cost": val}))
    return out


def add_evaluation_cost(plan: dict[str, Any], prep) -> dict[str, Any]:
    """``plan["evaluation"]``: one entry per evaluation (forward tokens and FLOPs of one pass, passes,
    seconds) and their totals, with the share of the training FLOPs (and time) they add."""
    spec, steps, tps = prep.components["model"], plan["steps"], plan.get("tokens_per_s")
    fpt0 = plan["seq_len_stages"][0]["flops_per_token"]
    train_flops = sum(s["tokens"] * s["flops_per_token"] for s in plan["seq_len_stages"])
    rows = []
    for name, answer in planned(prep):
        every, cost = int(answer["every"]), answer.get("cost")
        row: dict[str, Any] = {"name": name, "every": every, "passes": passes_in(steps, every)}
        if cost is None:
            row.update(unknown=str(answer.get("why") or "its work is unknown"))
        else:
            flops = forward_flops(cost, spec.flops_per_token)
            row.update(
                items=cost.items,
                requests=cost.requests,
                forwards=len(cost.forwards),
                forward_tokens=cost.tokens,
                flops_per_pass=flops,
                seconds_per_pass=flops / (tps * fpt0) if tps else None,  # at the ETA's model FLOP/s
                flops=flops * row["passes"],
            )
            row["seconds"] = row["seconds_per_pass"] * row["passes"] if tps else None
        rows.append(row)
    known = [r for r in rows if "unknown" not in r]
    flops = sum(r["flops"] for r in known)
    plan["evaluation"] = {
        "passes": rows,
        "flops": flops,
        "seconds": flops / (tps * fpt0) if tps else None,
        "fraction_of_training": flops / train_flops if train_flops else None,
        "unknown": [r["name"] for r in rows if "unknown" in r],
    }
    return plan
