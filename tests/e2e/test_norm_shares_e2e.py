"""``core.api.squared_norm_share`` under 2 real gloo ranks (``tests/workers/norm_shares.py``): summed
over the ranks, the shares of each parameter and of its gradient are the squared norms one process
computes on the same model and batch, under the ddp plugin (every rank holds the whole tensor) and the
fsdp2 plugin (each rank a DTensor shard of unequal size)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, torchrun_script


def test_the_ranks_shares_sum_to_the_single_process_squared_norm_under_ddp_and_fsdp2(tmp_path):
    out = tmp_path / "shares.json"
    r = torchrun_script(2, REPO / "tests" / "workers" / "norm_shares.py", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    single = ranks[0]["single"]
    assert ranks[1]["single"] == single and set(single) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    for parallelism in ("ddp", "fsdp2"):
        for name, whole in single.items():
            for kind in ("param", "grad"):
                parts = [got[parallelism][name][kind] for got in ranks]
                assert whole[kind] > 0 and sum(parts) == pytest.approx(whole[kind], rel=1e-5), (parallelism, name, kind, parts)
    first = [got["fsdp2"]["0.weight"]["param"] for got in ranks]
    assert first[0] > 100 * first[1], first  # each rank counted its own shard, not half of the whole
    assert [got["ddp"]["0.weight"]["param"] for got in ranks] == [single["0.weight"]["param"] / 2] * 2
