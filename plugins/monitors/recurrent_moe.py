"""``recurrent_moe``: health of a looped mixture-of-experts model.

Reads, on every log step, the statistics the model reports
(``extra_metrics``: loop-state cosine, expert output spread, tokens per
expert, router entropy) and applies thresholds:

* representation drift: consecutive loop states' cosine similarity < ``drift_cos``;
* expert collapse: the spread (std across experts) of expert outputs < ``collapse_spread``;
* load imbalance: max / mean tokens per expert > ``imbalance``;
* dead experts: an expert that got no token over the last ``dead_window`` log intervals.

Each signal's action is ``warn`` or ``stop`` (with a checkpoint). The values
themselves reach every logger through the step's metrics.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from typing import Literal

from core.hookspecs import hookimpl
from core.options import option

Action = Literal["warn", "stop"]


@dataclass
class RecurrentMoEMonitorOptions:
    drift_cos: float = option(0.5, "drift: consecutive loop states less similar than this (cosine)")
    collapse_spread: float = option(1e-6, "collapse: expert outputs spread less than this")
    imbalance: float = option(4.0, "imbalance: max/mean tokens per expert above this")
    dead_window: int = option(10, "dead expert: no tokens over this many log intervals")
    on_drift: Action = option("warn", "action on drift: warn or stop (with a checkpoint)")
    on_collapse: Action = option("stop", "action on expert collapse")
    on_imbalance: Action = option("warn", "action on load imbalance")
    on_dead: Action = option("warn", "action on a dead expert")


class RecurrentMoEMonitor:
    def __init__(self, options: RecurrentMoEMonitorOptions) -> None:
        self.options = options
        self.recent: deque[list[int]] = deque(maxlen=options.dead_window)
        self.fired: list[str] = []

    def signals(self, metrics) -> list[tuple[str, str, str]]:
        o = self.options
        out = []
        cos = metrics.get("moe/loop_cos_min")
        if cos is not None and cos < o.drift_cos:
            out.append(("drift", o.on_drift, f"loop states drift: cosine {cos:.3f} < {o.drift_cos}"))
        spread = metrics.get("moe/expert_spread_min")
        if spread is not None and spread < o.collapse_spread:
            out.append(("collapse", o.on_collapse, f"experts collapsed: output spread {spread:.3g} < {o.collapse_spread:g}"))
        ratio = metrics.get("moe/load_imbalance")
        if ratio is not None and ratio > o.imbalance:
            out.append(("imbalance", o.on_imbalance, f"load imbalance: max/mean tokens {ratio:.2f} > {o.imbalance}"))
        tokens = metrics.get("moe/expert_tokens")
        if tokens is not None:
            self.recent.append(tokens)
            if len(self.recent) == self.recent.maxlen:
                dead = [e for e in range(len(tokens)) if all(t[e] == 0 for t in self.recent)]
                if dead:
                    out.append(("dead", o.on_dead, f"dead experts {dead}: no tokens over {o.dead_window} log intervals"))
        return out

    @hookimpl
    def plait_step_end(self, run, step, metrics):
        if not metrics:
            return
        for name, action, text in self.signals(metrics):
            self.fired.append(name)
            run.state.setdefault("moe_alerts", {}).setdefault(name, 0)
            run.state["moe_alerts"][name] += 1
            if run.dist.is_main:
                print(f"plait: recurrent_moe: step {step}: {text} ({action})", file=sys.stderr, flush=True)
            if action == "stop":
                run.request_stop(f"recurrent_moe: {text}", checkpoint=True, source="recurrent_moe")
