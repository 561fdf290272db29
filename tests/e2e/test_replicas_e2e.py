"""core.checkpoint.replicas: each rank's share of a replicated state (what an async save copies)."""

from __future__ import annotations


def test_two_ranks_split_the_same_state_and_keep_everything_when_they_differ(tmp_path):
    """Plain tensors split over the ranks; HSDP's repeated DTensor shards split between the ranks holding them."""
    import json

    from conftest import REPO, torchrun_script

    out = tmp_path / "shares.json"
    r = torchrun_script(2, REPO / "tests" / "workers" / "replica_shares.py", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rank0, rank1 = json.loads(out.read_text())
    assert set(rank0["same"]) | set(rank1["same"]) == {f"w{i}" for i in range(6)}
    assert not set(rank0["same"]) & set(rank1["same"])
    assert rank0["differ"] is None and rank1["differ"] is None  # every rank passes all of it: DCP picks
    # HSDP's shards, repeated on both ranks, are split between them; fsdp2's own shard stays on each
    hsdp = {f"h{i}" for i in range(5)}
    assert set(rank0["dtensors"]) - {"f"} | set(rank1["dtensors"]) - {"f"} == hsdp
    assert not set(rank0["dtensors"]) & set(rank1["dtensors"]) - {"f"}
    assert "f" in rank0["dtensors"] and "f" in rank1["dtensors"]
    assert sorted([rank0["steps"], rank1["steps"]]) == [[], ["step"]]  # a plain tensor: one rank writes it
