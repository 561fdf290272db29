"""``spikes``: catch loss and gradient-norm spikes before they reach the weights.

Each step's loss (averaged over ranks) and global gradient norm are compared
with a rolling window of the previous ``window`` steps: a value more than
``sigmas`` standard deviations above the window's mean (and at least
``min_ratio`` times the mean) is a spike. Actions: ``log`` (a warning),
``skip`` (drop that update), ``rollback`` (restore the last complete
checkpoint and skip the data since then). Spikes never enter the window.
A lasting change of level is not a spike: after ``max_in_a_row`` spikes in a
row with ``skip`` or ``rollback`` (which would otherwise skip every update, or
roll back every step, for the rest of the run) the monitor stops the run with
exit code 3 and a checkpoint of its unchanged state.
Rehearse with the ``spike_rehearsal`` monitor.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Literal

from core.api import hookimpl, log, option


@dataclass
class SpikesOptions:
    window: int = option(20, "steps in the rolling window", ge=2)
    min_steps: int = option(10, "steps seen before detection starts", ge=2)
    sigmas: float = option(5.0, "a value this many standard deviations above the window mean is a spike", gt=0)
    min_ratio: float = option(1.3, "and at least this many times the window mean", gt=0)
    watch: list[str] = option(["loss", "grad_norm"], "signals to watch: loss, grad_norm")
    action: Literal["log", "skip", "rollback"] = option("skip", "what to do on a spike")
    max_in_a_row: int = option(
        10,
        "with skip or rollback: stop the run (exit code 3, with a checkpoint) after this many spikes in a row, a lasting change of level; 0: never",
        ge=0,
    )

    def check(self) -> None:
        bad = [w for w in self.watch if w not in ("loss", "grad_norm")]
        if bad:
            raise ValueError(f"watch: unknown signal {bad[0]!r}; signals: loss, grad_norm")


WINDOW_KEY = "spikes_window"  # run.state entry: the rolling windows, saved with each checkpoint
IN_A_ROW_KEY = "spikes_in_a_row"  # run.state entry: spikes since the last ordinary step
EXIT_LASTING = 3  # as a run whose loss stays non-finite: it cannot go on as it is


class Spikes:
    def __init__(self, options: SpikesOptions) -> None:
        self.options = options
        self.history: dict[str, deque[float]] = {name: deque(maxlen=options.window) for name in ("loss", "grad_norm")}
        self.spikes = 0
        self.in_a_row = 0  # on the monitor, not only in run.state: a rollback restores run.state

    def is_spike(self, name: str, value: float) -> bool:
        h = self.history[name]
        if len(h) < self.options.min_steps:
            return False
        mean = statistics.fmean(h)
        std = statistics.pstdev(h)
        return value > mean + self.options.sigmas * max(std, 1e-3 * abs(mean)) and value > self.options.min_ratio * mean

    @hookimpl
    def plait_train_start(self, run):
        """After a resume the window is the one the checkpoint saved (``run.state``), so detection
        goes on exactly where it was."""
        self.in_a_row = int(run.state.get(IN_A_ROW_KEY, 0))
        saved = run.state.get(WINDOW_KEY, {})
        for name, values in saved.items():
            if name in self.history:
                self.history[name].extend(float(v) for v in values)

    @hookimpl
    def plait_before_update(self, run, step, loss, grad_norm):
        values = {"loss": loss, "grad_norm": grad_norm}
        if not all(math.isfinite(v) for v in values.values()):
            return None  # the trainer skips non-finite steps itself; they never enter the window
        hits = [n for n in self.options.watch if self.is_spike(n, values[n])]
        if not hits:
            for name, value in values.items():
                self.history[name].append(value)
            run.state[WINDOW_KEY] = {name: list(h) for name, h in self.history.items()}  # saved in checkpoints
            self.in_a_row = run.state[IN_A_ROW_KEY] = 0
            return None
        self.spikes += 1
        run.state["spikes"] = run.state.get("spikes", 0) + 1
        self.in_a_row += 1
        run.state[IN_A_ROW_KEY] = self.in_a_row
        what = ", ".join(f"{n} {values[n]:.4g} (window mean {statistics.fmean(self.history[n]):.4g})" for n in hits)
        log.note(f"spikes: step {step}: spike in {what}; action: {self.options.action}")
        if self.options.action == "log":
            return None
        limit = self.options.max_in_a_row
        if limit and self.in_a_row >= limit:
            run.request_stop(
                f"spikes: {self.in_a_row} spikes in a row up to step {step} ({what}): the level has changed for good, not spiked; "
                f"every update would be {'skipped' if self.options.action == 'skip' else 'rolled back'}. Check the data and the "
                "learning rate, then resume (the window starts afresh) or raise monitors.spikes.max_in_a_row",
                checkpoint=True,
                source="spikes",
                exit_code=EXIT_LASTING,
            )
            self.in_a_row = run.state[IN_A_ROW_KEY] = 0
            run.state.pop(WINDOW_KEY, None)  # a resume judges the new level afresh
            return "skip"  # the weights stay as they are (a rollback now would only delay the stop)
        return self.options.action
