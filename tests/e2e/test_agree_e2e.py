"""core.runtime.distributed.agree: the one way ranks agree on small host-side values (flags, answers,
counts, every rank's object, rank 0's object), on two real gloo ranks in every mode."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, env

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


def test_two_ranks_agree_in_every_mode(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    out = tmp_path / "got"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store"), str(out)], cwd=REPO, env=env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"got.{r}").read_text()) for r in (0, 1)]
    assert got[0] == got[1], got  # the same on every rank
    assert got[0]["max"] == [1, 5]  # elementwise: rank 1's first value, rank 0's second
    assert got[0]["min"] == 7 and isinstance(got[0]["min"], int)  # the smallest rank's answer, an int
    assert got[0]["sum"] == [2.0, 0.75]  # float64 once any value is a float
    assert got[0]["all"] == [{"rank": 0, "why": "r0"}, {"rank": 1, "why": "r1"}]  # rank order
    assert got[0]["root"] == "from 0"
