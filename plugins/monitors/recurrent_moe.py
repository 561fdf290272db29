"""``recurrent_moe``: health of a looped mixture-of-experts model.

Reads, on every log step, the statistics the model reports
(``extra_metrics``: loop-state cosine, expert output spread, tokens per
expert, router entropy) and applies thresholds:

* representation drift: consecutive loop states' cosine similarity < ``drift_cos``;
* expert collapse: the spread (std across experts) of expert outputs < ``collapse_spread``;
* load imbalance: max / mean tokens per expert > ``imbalance``;
* dead experts: an expert that got no token over the last ``dead_window`` log intervals;
* router collapse: the mean router entropy (nats; at most ln(n_experts)) < ``router_entropy``.

Each signal's action is ``warn`` or ``stop`` (with a checkpoint). A warning of
one kind is printed at most once per ``warn_every`` steps; the next one that
is printed says how many were held back since the last (every occurrence is
still counted in the run state, ``moe_alerts``). The values themselves reach
every logger through the step's metrics.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from core.api import hookimpl, log, option

Action = Literal["warn", "stop"]
FIRED_KEPT = 100  # the latest signals the monitor remembers (a run that warns at every log step must not grow)


@dataclass
class RecurrentMoEMonitorOptions:
    drift_cos: float = option(0.5, "drift: consecutive loop states less similar than this (cosine)", ge=-1, le=1)
    collapse_spread: float = option(1e-6, "collapse: expert outputs spread less than this", ge=0)
    imbalance: float = option(4.0, "imbalance: max/mean tokens per expert above this", ge=1)
    dead_window: int = option(10, "dead expert: no tokens over this many log intervals", ge=1)
    router_entropy: float = option(0.1, "router collapse: mean router entropy below this (nats; ln(n_experts) is uniform routing)", ge=0)
    on_drift: Action = option("warn", "action on drift: warn or stop (with a checkpoint)")
    on_collapse: Action = option("stop", "action on expert collapse")
    on_imbalance: Action = option("warn", "action on load imbalance")
    on_dead: Action = option("warn", "action on a dead expert")
    on_entropy: Action = option("warn", "action on router collapse (low router entropy)")
    warn_every: int = option(
        100, "steps: a warning of one kind is printed at most once per this many steps, then with the count held back (0: every time)", ge=0
    )


class RecurrentMoEMonitor:
    def __init__(self, options: RecurrentMoEMonitorOptions) -> None:
        self.options = options
        self.recent: deque[list[int]] = deque(maxlen=options.dead_window)
        self.fired: deque[str] = deque(maxlen=FIRED_KEPT)  # the latest signals detected, printed or not
        self.printed: dict[str, int] = {}  # kind -> step of its last printed warning
        self.held: dict[str, int] = {}  # kind -> warnings not printed since then

    def signals(self, metrics) -> list[tuple[str, str, str]]:
        o = self.options
        out: list[tuple[str, str, str]] = []
        cos = metrics.get("moe/loop_cos_min")
        if cos is not None and cos < o.drift_cos:
            out.append(("drift", o.on_drift, f"loop states drift: cosine {cos:.3f} < {o.drift_cos}"))
        spread = metrics.get("moe/expert_spread_min")
        if spread is not None and spread < o.collapse_spread:
            out.append(("collapse", o.on_collapse, f"experts collapsed: output spread {spread:.3g} < {o.collapse_spread:g}"))
        ratio = metrics.get("moe/load_imbalance")
        if ratio is not None and ratio > o.imbalance:
            out.append(("imbalance", o.on_imbalance, f"load imbalance: max/mean tokens {ratio:.2f} > {o.imbalance}"))
        entropy = metrics.get("moe/router_entropy")
        if entropy is not None and entropy < o.router_entropy:
            out.append(("entropy", o.on_entropy, f"router collapse: mean router entropy {entropy:.3f} < {o.router_entropy:g} nats"))
        tokens = metrics.get("moe/expert_tokens")
        if tokens is not None:
            self.recent.append(tokens)
            if len(self.recent) == self.recent.maxlen:
                dead = [e for e in range(len(tokens)) if all(t[e] == 0 for t in self.recent)]
                if dead:
                    out.append(("dead", o.on_dead, f"dead experts {dead}: no tokens over {o.dead_window} log intervals"))
        return out

    def due(self, kind: str, step: int) -> str | None:
        """The suffix for a warning of ``kind`` printed now, or None when it is held back (rate limit)."""
        last = self.printed.get(kind)
        if last is not None and self.options.warn_every and step - last < self.options.warn_every:
            self.held[kind] = self.held.get(kind, 0) + 1
            return None
        held = self.held.pop(kind, 0)
        self.printed[kind] = step
        return f"; {held} more since step {last} not shown" if held else ""

    @hookimpl
    def plait_step_end(self, run, step, metrics):
        if not metrics:
            return
        for name, action, text in self.signals(metrics):
            self.fired.append(name)
            run.state.setdefault("moe_alerts", {}).setdefault(name, 0)
            run.state["moe_alerts"][name] += 1
            suffix = self.due(name, step) if action == "warn" else ""
            if suffix is not None:
                log.note(f"recurrent_moe: step {step}: {text} ({action}{suffix})")
            if action == "stop":
                run.request_stop(f"recurrent_moe: {text}", checkpoint=True, source="recurrent_moe")
