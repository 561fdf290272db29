"""core.runtime.distributed.agree on one process: each mode (max, min, sum, all, root) gives the process
its own values back without a process group, and an unknown mode is refused naming the modes."""

from __future__ import annotations

import pytest
import torch.distributed as tdist

from core.contract.protocols import DistInfo
from core.runtime.distributed import AGREE_MODES, ControlPlane, agree


def test_one_process_gets_its_own_values_back():
    assert agree([3, 1], "max", None) == [3, 1]
    assert agree(4, "min", None) == 4
    assert agree(2.5, "sum", None) == 2.5
    assert agree("mine", "all", None) == ["mine"]
    assert agree({"a": 1}, "root", None) == {"a": 1}
    assert not tdist.is_initialized()
    control = ControlPlane(DistInfo())
    assert control.agree([0, 1], "max") == [0, 1]


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match=r"agree: mode 'any'; expected one of max, min, sum, all, root"):
        agree(1, "any", None)
    assert AGREE_MODES == ("max", "min", "sum", "all", "root")
