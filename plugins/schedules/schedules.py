"""Learning-rate multipliers as pure functions of (step, total_steps); steps are 0-based.

The core calls ``multiplier(step, total_steps)`` through ``LambdaLR``: the
optimizer step with index ``s`` (0-based) runs at ``peak_lr * m(s)``.

Warmup: the multiplier at step ``s < W`` is ``(s + 1) / W``, so the first step
runs at ``1/W`` of the peak and step ``W - 1`` at the peak. Cosine: from the
peak at step ``W - 1`` to ``min_lr_ratio`` at the last step ``T - 1``::

    m(s) = r + (1 - r) * (1 + cos(pi * (s - W + 1) / (T - W))) / 2

so the midpoint ``s = W - 1 + (T - W) / 2`` runs at ``(1 + r) / 2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from core.api import option


def warmup_steps_of(warmup_steps: int, warmup_fraction: float, total_steps: int) -> int:
    """Warmup length in steps: ``warmup_steps`` if set, else ``round(warmup_fraction * total_steps)``.

    A non-zero fraction gives at least one warmup step.
    """
    if warmup_steps:
        return warmup_steps
    if warmup_fraction <= 0:
        return 0
    return max(1, int(round(warmup_fraction * total_steps)))


def warmup(step: int, warmup: int) -> float | None:
    """The linear warmup multiplier ``(step + 1) / warmup`` for ``step < warmup``, else None."""
    return (step + 1) / warmup if step < warmup else None


def cosine(step: int, total: int, warmup_n: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup_n`` steps, then cosine from 1 to ``min_ratio`` at step ``total - 1``.

    Steps past the end stay at ``min_ratio``.
    """
    w = warmup(step, warmup_n)
    if w is not None:
        return w
    span = max(total - warmup_n, 1)
    progress = min(max((step - warmup_n + 1) / span, 0.0), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _check_warmup_and_ratio(o) -> None:
    if o.warmup_steps and o.warmup_fraction:
        raise ValueError("set warmup_steps or warmup_fraction, not both")
    if o.warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {o.warmup_steps}")
    if not 0 <= o.warmup_fraction <= 1:
        raise ValueError(f"warmup_fraction must be in [0, 1], got {o.warmup_fraction}")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")


@dataclass
class WarmupCosineOptions:
    warmup_steps: int = option(0, "steps of linear warmup", ge=0)
    warmup_fraction: float = option(0.0, "warmup as a fraction of all steps, used when warmup_steps is 0", ge=0, le=1)
    min_lr_ratio: float = option(0.1, "final LR as a fraction of the peak", ge=0, le=1)

    def check(self) -> None:
        _check_warmup_and_ratio(self)


class WarmupCosine:
    """Linear warmup, then cosine decay to ``min_lr_ratio`` at the last step (see :func:`cosine`)."""

    def __init__(self, options: WarmupCosineOptions) -> None:
        self.options = options

    def multiplier(self, step: int, total_steps: int) -> float:
        o = self.options
        return cosine(step, total_steps, warmup_steps_of(o.warmup_steps, o.warmup_fraction, total_steps), o.min_lr_ratio)


@dataclass
class ConstantOptions:
    warmup_steps: int = option(0, "steps of linear warmup before the constant LR", ge=0)

    def check(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")


class Constant:
    """Linear warmup over ``warmup_steps``, then 1.0."""

    def __init__(self, options: ConstantOptions) -> None:
        self.options = options

    def multiplier(self, step: int, total_steps: int) -> float:
        w = warmup(step, self.options.warmup_steps)
        return 1.0 if w is None else w


DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def decay(progress: float, shape: str, min_ratio: float) -> float:
    """From 1 at progress 0 to min_ratio at progress 1."""
    p = min(max(progress, 0.0), 1.0)
    if shape == "linear":
        f = 1 - p
    elif shape == "cosine":
        f = 0.5 * (1 + math.cos(math.pi * p))
    else:  # 1-sqrt (Hägele et al. 2024)
        f = 1 - math.sqrt(p)
    return min_ratio + (1 - min_ratio) * f


@dataclass
class WSDOptions:
    warmup_steps: int = option(0, "steps of linear warmup", ge=0)
    warmup_fraction: float = option(0.0, "warmup as a fraction of all steps, used when warmup_steps is 0", ge=0, le=1)
    decay_fraction: float = option(0.2, "the last fraction of steps that decays", gt=0, le=1)
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = option("1-sqrt", "shape of the decay")
    min_lr_ratio: float = option(0.0, "final LR as a fraction of the peak", ge=0, le=1)

    def check(self) -> None:
        _check_warmup_and_ratio(self)
        if not 0 < self.decay_fraction <= 1:
            raise ValueError("decay_fraction must be in (0, 1]")


class WSD:
    """Warmup, stable at the peak, then decay over the last ``decay_fraction`` of the steps."""

    def __init__(self, options: WSDOptions) -> None:
        self.options = options

    def multiplier(self, step: int, total_steps: int) -> float:
        o = self.options
        w = warmup(step, warmup_steps_of(o.warmup_steps, o.warmup_fraction, total_steps))
        if w is not None:
            return w
        decay_steps = max(int(round(o.decay_fraction * total_steps)), 1)
        start = total_steps - decay_steps
        if step < start:
            return 1.0
        return decay((step - start + 1) / decay_steps, o.decay_shape, o.min_lr_ratio)


@dataclass
class LinearOptions:
    warmup_steps: int = option(0, "steps of linear warmup", ge=0)
    warmup_fraction: float = option(0.0, "warmup as a fraction of all steps, used when warmup_steps is 0", ge=0, le=1)
    min_lr_ratio: float = option(0.0, "final LR as a fraction of the peak", ge=0, le=1)

    def check(self) -> None:
        _check_warmup_and_ratio(self)


class Linear:
    """Warmup, then a straight line from the peak to ``min_lr_ratio`` at the last step."""

    def __init__(self, options: LinearOptions) -> None:
        self.options = options

    def multiplier(self, step: int, total_steps: int) -> float:
        o = self.options
        n = warmup_steps_of(o.warmup_steps, o.warmup_fraction, total_steps)
        w = warmup(step, n)
        if w is not None:
            return w
        return decay((step - n + 1) / max(total_steps - n, 1), "linear", o.min_lr_ratio)
