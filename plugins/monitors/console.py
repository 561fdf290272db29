"""``console``: one line per log interval on stdout, rank 0 only.

The step line is chosen by ``format``: ``"default"``::

    step 120/1000 | loss 2.3456 | gnorm 0.812 | lr 3.00e-04 | 12,345 tok/s | tokens 1.23M | elapsed 0:01:02 | eta 0:09:10

``"moe"``, the recurrent-MoE guide's line (with the model's ``z`` loss where
the guide's model had its boundary-predictor loss)::

    Epoch 1 | step    10/152000 | loss 3.2140 | lm 3.1020 | aux 0.0312 | z 0.0012 | gnorm 1.23 | lr 3.00e-04 | 0.42M tok/s | 0.07B tokens

or a template of ``{field:spec}`` placeholders (Python format specs) over
:data:`FIELDS`, checked at start: an unknown field or a bad spec is one line,
exit 2. Segments are the text between ``" | "``; a segment whose field has no
value this run (``epoch`` when the data does not know its size, ``lm`` for a
model without loss parts) is left out. Then ``| key value`` follows for each
name in ``extra`` present in the metrics. Validation results, committed
checkpoints and the end of the run get a line each.
"""

from __future__ import annotations

import datetime
import math
import string
from dataclasses import dataclass
from typing import Any

from core.api import closest, hookimpl, option


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


# Fields a template may name: doc, and a sample value (its type) that checks the format specs at start.
FIELDS: dict[str, tuple[str, Any]] = {
    "epoch": ("the epoch being trained, from 1 (tokens seen over the data's size; only where the source knows it)", 1),
    "epochs": ("epochs completed, fractional (the logged metric epoch)", 0.5),
    "step": ("optimizer steps completed", 10),
    "total_steps": ("the run's last step", 1000),
    "steps_width": ("digits of total_steps, for alignment: {step:>{steps_width}}", 4),
    "loss": ("mean loss of the step over all ranks", 1.0),
    "lm": ("language-modelling part of the loss (models with loss parts)", 1.0),
    "aux": ("load-balancing part of the loss (MoE models)", 1.0),
    "z": ("router z-loss part (MoE models)", 1.0),
    "gnorm": ("global gradient norm before clipping", 1.0),
    "lr": ("learning rate applied at this step", 1.0),
    "tok_s": ("tokens per second, all ranks", 1.0),
    "mtok_s": ("tokens per second in millions", 1.0),
    "tokens": ("tokens seen since the start of the run", 1),
    "tokens_si": ("tokens seen with a K/M/B suffix (1.23M)", "1.23M"),
    "mtokens": ("tokens seen in millions", 1.0),
    "btokens": ("tokens seen in billions", 1.0),
    "elapsed": ("training wall time, H:MM:SS", "0:00:01"),
    "eta": ("estimated time to the end, H:MM:SS", "0:00:01"),
    "step_time_s": ("mean seconds per step over the log window", 1.0),
    "mfu": ("model FLOPs utilization (left out where unknown)", 1.0),
}

FORMATS: dict[str, str] = {
    "default": "step {step}/{total_steps} | loss {loss:.4f} | gnorm {gnorm:.3f} | lr {lr:.2e} | {tok_s:,.0f} tok/s"
    " | tokens {tokens_si} | elapsed {elapsed} | eta {eta}",
    "moe": "Epoch {epoch} | step {step:5d}/{total_steps} | loss {loss:.4f} | lm {lm:.4f} | aux {aux:.4f}"
    " | z {z:.4f} | gnorm {gnorm:.2f} | lr {lr:.2e} | {mtok_s:.2f}M tok/s | {btokens:.2f}B tokens",
}
SEPARATOR = " | "


def template_fields(template: str) -> list[str]:
    """The field names a template uses, nested ones (in format specs) included."""
    names = []
    for _, field, spec, _ in string.Formatter().parse(template):
        if field is not None:
            names.append(field.split(".")[0].split("[")[0])
            names += template_fields(spec or "")
    return names


def check_template(template: str) -> None:
    """Raise ValueError (one line) for an unknown field or a format spec its value cannot take."""
    try:
        names = template_fields(template)
    except ValueError as e:
        raise ValueError(f"format {template!r}: {e}") from None
    for name in names:
        if name not in FIELDS:
            what = "positional {} placeholders are not allowed" if name == "" or name.isdigit() else f"unknown field {name!r}{closest(name, FIELDS)}"
            raise ValueError(f"format {template!r}: {what}; fields: {', '.join(FIELDS)} (or a preset: {', '.join(FORMATS)})")
    try:
        template.format(**{k: v for k, (_, v) in FIELDS.items()})
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise ValueError(f"format {template!r}: bad format spec ({e})") from None


def field_values(run, step: int, m: dict[str, Any]) -> dict[str, Any]:
    """Every field of :data:`FIELDS` from the step's metrics; None where this run has no value."""

    def number(key: str) -> float | None:
        value = num(m.get(key))
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    epochs, tok_s, seen = number("epoch"), number("tokens_per_s"), number("tokens_seen")
    return {
        "epoch": int(epochs) + 1 if epochs is not None and math.isfinite(epochs) else None,
        "epochs": epochs,
        "step": step,
        "total_steps": run.total_steps,
        "steps_width": len(str(run.total_steps)),
        "loss": number("loss"),
        "lm": number("lm"),
        "aux": number("aux"),
        "z": number("z"),
        "gnorm": number("grad_norm"),
        "lr": number("lr"),
        "tok_s": tok_s,
        "mtok_s": tok_s / 1e6 if tok_s is not None else None,
        "tokens": int(seen) if seen is not None else None,
        "tokens_si": si(seen) if seen is not None else None,
        "mtokens": seen / 1e6 if seen is not None else None,
        "btokens": seen / 1e9 if seen is not None else None,
        "elapsed": hms(m["elapsed_s"]) if "elapsed_s" in m else None,
        "eta": hms(m["eta_s"]) if "eta_s" in m else None,
        "step_time_s": number("step_time_s"),
        "mfu": number("mfu"),
    }


def render(template: str, values: dict[str, Any]) -> str:
    """The template with its values; a segment (between ``" | "``) naming a field without a value is left out."""
    out = []
    for segment in template.split(SEPARATOR):
        if any(values.get(name) is None for name in template_fields(segment)):
            continue
        out.append(segment.format(**values))
    return SEPARATOR.join(out)


@dataclass
class ConsoleOptions:
    format: str = option(
        "default",
        'the step line: "default", "moe" (the recurrent-MoE guide\'s: Epoch, step, '
        "loss parts, gnorm, lr, M tok/s, B tokens) or a template of {field:spec} "
        "placeholders (fields in docs/metrics.md)",
    )
    extra: list[str] = option([], "further metric names to print when present (e.g. lm, aux)")

    def check(self) -> None:
        check_template(self.template)

    @property
    def template(self) -> str:
        return FORMATS.get(self.format, self.format)


class Console:
    def __init__(self, options: ConsoleOptions) -> None:
        self.options = options
        check_template(options.template)

    @staticmethod
    def _print(run, text: str) -> None:
        if run.dist.is_main:
            print(text, flush=True)

    def format_step(self, run, step: int, m: dict[str, Any]) -> str:
        line = render(self.options.template, field_values(run, step, m))
        parts = [line] if line else []
        for key in self.options.extra:
            if key in m:
                parts.append(f"{key} {fmt(m[key])}")
        return SEPARATOR.join(parts)

    @hookimpl
    def plait_train_start(self, run):
        if run.step >= run.total_steps:
            self._print(run, f"plait: nothing to train: the run is at step {run.step} and train.steps is {run.total_steps}")
            return
        self._print(
            run,
            f"plait: training steps {run.step + 1}-{run.total_steps} on {run.dist.world_size} rank(s), "
            f"{run.tokens_per_step:,} tokens/step, output {run.output_dir}",
        )

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
