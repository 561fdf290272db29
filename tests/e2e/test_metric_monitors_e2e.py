"""The mfu, memory and update_ratio monitors over real runs: the ratios and mfu land in metrics.jsonl,
on one process and on 2 gloo ranks with sharded parameters, and update_ratio under fsdp2 and HSDP is the
whole model's ratio."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import read_metrics, run_module, torchrun, write_tiny_config

MONITORS = '--monitors.enabled=["jsonl", "mfu", "memory", "update_ratio"]'


def test_metrics_reach_the_log_through_the_monitors(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=4)
    proc = run_module("core.train", "--config", str(cfg), "--train.log_every=2", MONITORS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert r["mfu"] == "n/a" and r["peak_tflops"] == "n/a" and "mem_peak_gib" not in r  # a CPU: no guess
        assert {"update_ratio/matrix", "update_ratio/embedding", "update_ratio/norm"} <= set(r), r
        assert all(0 < r[k] < 1 for k in r if k.startswith("update_ratio/")), r
    bare = run_module("core.train", "--config", str(cfg), "--train.log_every=2", '--monitors.enabled=["jsonl"]', f"--train.output_dir={tmp_path / 'bare'}")
    assert bare.returncode == 0, bare.stderr[-3000:]
    assert not any(k.startswith(("update_ratio/", "mfu")) for r in read_metrics(tmp_path / "bare") for k in r)


def test_update_ratio_with_sharded_parameters_on_two_ranks(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=2)
    proc = torchrun(2, "--config", str(cfg), "--parallelism.name=fsdp2", MONITORS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 < r["update_ratio/matrix"] < 1 for r in rows), rows
    one = (
        read_metrics(tmp_path / "one")
        if run_module("core.train", "--config", str(cfg), f"--train.output_dir={tmp_path / 'one'}", MONITORS).returncode == 0
        else []
    )
    assert one, "the one-process run of the same config failed"
    for r in rows:  # each rank holds its fsdp2 shard (row shards of each parameter, padded: about half), AdamW's two moments of it
        assert 0.45 * one[-1]["mem_params_gib"] < r["mem_params_gib"] < 0.6 * one[-1]["mem_params_gib"], (r, one[-1])
        assert r["mem_grads_gib"] == r["mem_params_gib"] and r["mem_optimizer_gib"] == pytest.approx(2 * r["mem_params_gib"], rel=0.01), r


def test_update_ratio_under_fsdp2_and_hsdp_is_the_whole_models_ratio(tmp_path):
    """Under fsdp2 each rank reported the ratio of its own shard (its own norm of its shard, not the
    model's): rank 0's, whose rows are 50x larger here, was far from the whole model's. The ranks' sums
    are reduced by the core now (``core.api.Reduced``): every rank reports the ratio a single process
    reports on the same weights, and the one computed from the gathered weights (fsdp2, and HSDP whose
    replicated shards count once)."""
    import json

    from conftest import REPO, torchrun_script

    out = tmp_path / "ratios.json"
    r = torchrun_script(2, REPO / "tests" / "workers" / "update_ratio_ranks.py", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads(Path(f"{out}.{rank}").read_text())
        single = got["single"]
        assert set(single) == {"update_ratio/matrix", "update_ratio/bias"}
        for parallelism in ("fsdp2", "hsdp"):
            for group in ("matrix", "bias"):
                value = got[parallelism]["got"][f"update_ratio/{group}"]
                assert value == pytest.approx(got[parallelism]["whole"][group], rel=1e-5), (rank, parallelism, group)
                assert value == pytest.approx(single[f"update_ratio/{group}"], rel=1e-4), (rank, parallelism, group)
