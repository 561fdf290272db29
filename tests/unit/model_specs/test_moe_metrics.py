"""core.contract.metrics.reduce_parts on one process (each part reduced by its op; an unknown op is
refused naming the part), and a validation forward leaves the recurrent MoE's step parts as they were."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import REPO

from core.contract.metrics import reduce_parts
from core.contract.protocols import DistInfo

sys.path.insert(0, str(REPO / "tests" / "workers"))
import moe_parts  # noqa: E402


def test_reduce_parts_single_process_and_bad_op():
    parts = {"a": ("mean", torch.tensor(2.0)), "b": ("sum", torch.tensor([1, 2])), "c": ("min", torch.tensor(-1.5))}
    got = reduce_parts(parts, DistInfo())
    assert float(got["a"]) == 2.0 and got["b"].tolist() == [1.0, 2.0] and float(got["c"]) == -1.5
    with pytest.raises(ValueError, match="'d' asks for reduction 'median'"):
        reduce_parts({"d": ("median", torch.tensor(1.0))}, DistInfo())


def test_validation_forward_does_not_touch_the_step_parts():
    model = moe_parts.build()
    ids = moe_parts.batch(0, 0, 0)
    model(ids, ids).backward()
    before = model.extra_metrics()
    model(ids, ids).backward()  # the gradient exists: a second micro-batch of the same step
    with torch.no_grad():
        model(moe_parts.batch(1, 5, 5), moe_parts.batch(1, 5, 5))  # validation
    after = model.extra_metrics()
    assert after["lm"] == pytest.approx(before["lm"], rel=1e-6)
    assert sum(after["moe/expert_tokens"]) == sum(before["moe/expert_tokens"])  # counts since the last call
