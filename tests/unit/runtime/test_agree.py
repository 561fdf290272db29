"""core.runtime.distributed.agree: the one way ranks agree on small host-side values (flags, answers,
counts, every rank's object, rank 0's object), on one process and on two real gloo ranks."""

from __future__ import annotations

import pytest
import torch.distributed as tdist

from core.contract.protocols import DistInfo
from core.runtime.distributed import AGREE_MODES, ControlPlane, agree

TWO_RANKS = r"""
import json, sys
import torch.distributed as tdist
import torch.multiprocessing as mp

def rank_main(rank, store_path, out):
    from core.runtime.distributed import agree
    tdist.init_process_group("gloo", store=tdist.FileStore(store_path, 2), rank=rank, world_size=2)
    group = tdist.group.WORLD
    got = {
        "max": agree([rank, 5 - rank], "max", group),
        "min": agree(7 + rank, "min", group),
        "sum": agree([1, 0.25 * (rank + 1)], "sum", group),
        "all": agree({"rank": rank, "why": f"r{rank}"}, "all", group),
        "root": agree(f"from {rank}", "root", group),
    }
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)
    tdist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1], sys.argv[2]), nprocs=2)
"""


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
