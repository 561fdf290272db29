"""A plan's ETA and cost: the throughput from ``--tokens-per-s``, a measurement or the budget
guard's ``expected_tokens_per_s``; later sequence-length stages scaled by their FLOPs per token;
cost = USD per device-hour x devices x hours."""

from __future__ import annotations

from typing import Any


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
