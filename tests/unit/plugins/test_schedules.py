"""LR schedules: exact multipliers at the warmup end, the cosine midpoint and the last step; option checks."""

from __future__ import annotations

import math

import pytest

from core.contract.errors import ConfigError
from core.contract.option_values import build_options
from plugins.schedules.schedules import (
    Constant,
    ConstantOptions,
    WarmupCosine,
    WarmupCosineOptions,
    cosine,
    warmup,
    warmup_steps_of,
)


def test_warmup_cosine_exact_points():
    s = WarmupCosine(WarmupCosineOptions(warmup_steps=10, min_lr_ratio=0.1))
    total = 110
    assert s.multiplier(0, total) == pytest.approx(0.1)  # (0 + 1) / 10
    assert s.multiplier(4, total) == pytest.approx(0.5)
    assert s.multiplier(9, total) == 1.0  # warmup end: the peak
    # cosine over the T - W = 100 steps after the peak; progress 0.5 at step 9 + 50
    assert s.multiplier(59, total) == pytest.approx((1 + 0.1) / 2)
    assert s.multiplier(34, total) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert s.multiplier(109, total) == pytest.approx(0.1)  # the last step reaches min_lr_ratio
    assert s.multiplier(500, total) == pytest.approx(0.1)  # past the end it stays there


def test_warmup_cosine_monotone_after_warmup():
    s = WarmupCosine(WarmupCosineOptions(warmup_steps=5, min_lr_ratio=0.0))
    values = [s.multiplier(i, 50) for i in range(50)]
    assert values[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(a >= b for a, b in zip(values[4:], values[5:]))
    assert values[-1] == pytest.approx(0.0, abs=1e-12)


def test_warmup_cosine_no_warmup_starts_at_peak():
    s = WarmupCosine(WarmupCosineOptions(min_lr_ratio=0.2))
    assert s.multiplier(0, 101) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 101)))
    assert s.multiplier(100, 101) == pytest.approx(0.2)


def test_warmup_fraction():
    s = WarmupCosine(WarmupCosineOptions(warmup_fraction=0.1, min_lr_ratio=0.0))
    assert warmup_steps_of(0, 0.1, 200) == 20
    assert s.multiplier(0, 200) == pytest.approx(1 / 20)
    assert s.multiplier(19, 200) == 1.0
    assert s.multiplier(19 + 90, 200) == pytest.approx(0.5)  # midpoint of the 180 decay steps
    assert s.multiplier(199, 200) == pytest.approx(0.0, abs=1e-12)
    assert warmup_steps_of(0, 0.001, 100) == 1  # a non-zero fraction warms up at least one step
    assert warmup_steps_of(7, 0.0, 100) == 7


def test_pure_functions():
    assert warmup(2, 4) == 0.75 and warmup(4, 4) is None and warmup(0, 0) is None
    assert cosine(9, 110, 10, 0.3) == 1.0
    assert cosine(59, 110, 10, 0.3) == pytest.approx(0.65)
    assert cosine(0, 1, 0, 0.3) == pytest.approx(0.3)  # a one-step run sits at the end of the decay


def test_constant():
    assert [Constant(ConstantOptions()).multiplier(i, 10) for i in (0, 5, 9)] == [1.0, 1.0, 1.0]
    c = Constant(ConstantOptions(warmup_steps=4))
    assert [c.multiplier(i, 10) for i in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


@pytest.mark.parametrize(
    "table, match",
    [
        ({"warmup_steps": 10, "warmup_fraction": 0.1}, "not both"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"min_lr_ratio": -0.1}, "min_lr_ratio"),
        ({"warmup_fraction": 1.2}, "warmup_fraction"),
        ({"warmup_steps": -1}, "warmup_steps"),
    ],
)
def test_warmup_cosine_check(table, match):
    with pytest.raises(ConfigError, match=match):
        build_options(WarmupCosineOptions, table, "[lr_schedule]")


def test_options_from_toml_and_constant_check():
    o = build_options(WarmupCosineOptions, {"warmup_fraction": 0, "min_lr_ratio": 0}, "[lr_schedule]")
    assert o.warmup_fraction == 0.0 and isinstance(o.min_lr_ratio, float)
    with pytest.raises(ConfigError, match=r"\[lr_schedule\]\.warmup_steps: must be >= 0, got -3"):
        build_options(ConstantOptions, {"warmup_steps": -3}, "[lr_schedule]")


def test_registered():
    import plugins.schedules as mod
    from core.config.registry import Registry

    registry = Registry()
    mod.plait_register(registry=registry)
    assert {"warmup_cosine", "constant"} <= set(registry.names("lr_schedule"))
    comp = registry.get("lr_schedule", "warmup_cosine", "[lr_schedule]")
    sched = comp.factory(comp.options(warmup_steps=2))
    assert sched.multiplier(1, 10) == 1.0


def test_warmup_beyond_the_run_is_warned(tiny_config):
    from conftest import run_here

    r = run_here("core.plan", "--config", str(tiny_config(steps=6)), "--lr_schedule.warmup_steps=10")
    assert r.returncode == 0 and "never reaches its peak" in r.stderr
