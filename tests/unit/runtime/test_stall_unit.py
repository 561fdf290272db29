"""``train.stall_timeout_s`` that is negative, NaN or infinite is bad input naming the key."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_stall_timeout_that_is_not_a_finite_non_negative_number_is_bad_input(value):
    from core.config.sections import TrainOptions
    from core.contract.errors import ConfigError
    from core.contract.option_values import build_options

    with pytest.raises(ConfigError, match=r"\[train\]\.stall_timeout_s"):
        build_options(TrainOptions, {"steps": 1, "stall_timeout_s": value}, "run.toml: [train]")
