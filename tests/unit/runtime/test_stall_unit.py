"""The stall watchdog (``core/runtime/watchdog.py``, ``train.stall_timeout_s``) on real 2-rank gloo runs:
a run with a rank that hangs outside a collective is ended for a restart, every rank naming the one
that holds the others up; a slow run that keeps making progress is left alone; a hang in teardown,
after the run's end is recorded, ends the process but keeps that record."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_stall_timeout_that_is_not_a_finite_non_negative_number_is_bad_input(value):
    from core.config.sections import TrainOptions
    from core.contract.errors import ConfigError
    from core.contract.option_values import build_options

    with pytest.raises(ConfigError, match=r"\[train\]\.stall_timeout_s"):
        build_options(TrainOptions, {"steps": 1, "stall_timeout_s": value}, "run.toml: [train]")
