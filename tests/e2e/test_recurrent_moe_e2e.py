"""The recurrent MoE model trains through ``core.train`` and logs each of its loss parts."""

from __future__ import annotations

from conftest import read_metrics, run_module


def test_trains_and_logs_each_loss(tmp_path):
    """The shipped config, 20 steps of half its batch (two micro-batches per step): the loss falls
    by ~2.4 (measured), and every loss part and health metric of the monitor is logged."""
    proc = run_module(
        "core.train",
        "--config",
        "train_configs/recurrent_moe_debug.toml",
        f"--train.output_dir={tmp_path}",
        "--train.steps=20",
        "--train.log_every=5",
        "--train.global_batch_tokens=2048",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.8
    for key in ("lm", "aux", "z", "moe/loop_cos_min", "moe/expert_spread_min", "moe/load_imbalance", "moe/router_entropy"):
        assert key in rows[-1], key
    assert len(rows[-1]["moe/expert_tokens"]) == 4 and sum(rows[-1]["moe/expert_tokens"]) > 0
    assert "| lm " in proc.stdout and "| aux " in proc.stdout
