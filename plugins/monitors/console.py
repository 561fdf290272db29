"""``console``: one line per log interval on stdout, rank 0 only.

    step 120/1000 | loss 2.3456 | gnorm 0.812 | lr 3.00e-04 | 12,345 tok/s | tokens 1.23M | elapsed 0:01:02 | eta 0:09:10

followed by ``| key value`` for each name in ``extra`` present in the metrics.
Validation results, committed checkpoints and the end of the run get a line
each.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any

from core.hookspecs import hookimpl
from core.options import option


def num(value: Any) -> Any:
    """A 0-dim tensor or numpy scalar as a Python number; anything else unchanged."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def hms(seconds: float) -> str:
    """``H:MM:SS`` (``D day(s), H:MM:SS`` past a day); ``?`` when not finite."""
    seconds = float(num(seconds))
    if not math.isfinite(seconds):
        return "?"
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


def si(n: float) -> str:
    """A count with a K/M/B suffix: ``1.23M``."""
    n = float(num(n))
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def fmt(value: Any) -> str:
    """Floats with 4 decimals (scientific notation when tiny or huge); other values as ``str``."""
    value = num(value)
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value) or 1e-3 <= abs(value) < 1e6:
            return f"{value:.4f}"
        return f"{value:.3e}"
    return str(value)


@dataclass
class ConsoleOptions:
    extra: list[str] = option([], "further metric names to print when present (e.g. lm, aux)")


class Console:
    def __init__(self, options: ConsoleOptions) -> None:
        self.options = options

    @staticmethod
    def _print(run, text: str) -> None:
        if run.dist.is_main:
            print(text, flush=True)

    def format_step(self, run, step: int, m: dict[str, Any]) -> str:
        parts = [
            f"step {step}/{run.total_steps}",
            f"loss {float(num(m['loss'])):.4f}",
            f"gnorm {float(num(m['grad_norm'])):.3f}",
            f"lr {float(num(m['lr'])):.2e}",
            f"{float(num(m['tokens_per_s'])):,.0f} tok/s",
            f"tokens {si(m['tokens_seen'])}",
            f"elapsed {hms(m['elapsed_s'])}",
            f"eta {hms(m['eta_s'])}",
        ]
        for key in self.options.extra:
            if key in m:
                parts.append(f"{key} {fmt(m[key])}")
        return " | ".join(parts)

    @hookimpl
    def plait_train_start(self, run):
        self._print(run, f"plait: training steps {run.step + 1}-{run.total_steps} on {run.dist.world_size} rank(s), "
                         f"{run.tokens_per_step:,} tokens/step, output {run.output_dir}")

    @hookimpl
    def plait_step_end(self, run, step, metrics):
        if not metrics or not run.dist.is_main:
            return
        self._print(run, self.format_step(run, step, metrics))

    @hookimpl
    def plait_validation_end(self, run, step, metrics):
        if not run.dist.is_main:
            return
        parts = [f"step {step}/{run.total_steps}"]
        parts += [f"{k} {fmt(v)}" for k, v in metrics.items() if k != "step"]
        self._print(run, " | ".join(parts))

    @hookimpl
    def plait_checkpoint_saved(self, run, step, path):
        self._print(run, f"step {step}: checkpoint committed at {path}")

    @hookimpl
    def plait_train_end(self, run, reason):
        self._print(run, f"plait: training ended at step {run.step} ({reason})")
