"""Spike rehearsal: an injected spike is detected and handled by each action."""

from __future__ import annotations

import json

import pytest
from conftest import read_metrics, run_module

pytestmark = pytest.mark.slow


def rehearse(tiny_config, tmp_path, action):
    cfg = tiny_config(steps=20)
    proc = run_module(
        "core.train",
        "--config",
        str(cfg),
        "--optimizer.lr=3e-3",
        "--train.inject_spike_at_step=15",
        '--monitors.enabled=["console", "jsonl", "spikes"]',
        f"--monitors.spikes.action={action}",
        "--monitors.spikes.window=5",
        "--monitors.spikes.min_steps=5",
        "--checkpoint.every=5",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("injected spike batch") >= 5
    return proc


def test_log_only_reports(tiny_config, tmp_path):
    proc = rehearse(tiny_config, tmp_path, "log")
    assert "spikes: step 15: spike in loss" in proc.stderr and "action: log" in proc.stderr
    assert "update skipped" not in proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "out")][-1] == 20


def test_skip_drops_the_spiking_updates(tiny_config, tmp_path):
    proc = rehearse(tiny_config, tmp_path, "skip")
    assert proc.stdout.count("update skipped") == 5  # the five injected steps, nothing else
    for step in range(15, 20):
        assert f"plait: step {step}: update skipped" in proc.stdout
    rows = {r["step"]: r for r in read_metrics(tmp_path / "out")}
    assert rows[20]["loss"] < rows[15]["loss"] - 1.0  # the weights never took the spike


def test_rollback_restores_and_skips_the_data(tiny_config, tmp_path):
    proc = rehearse(tiny_config, tmp_path, "rollback")
    assert "rolled back to step_000000010" in proc.stdout
    state = json.loads((tmp_path / "out" / "checkpoints" / "step_000000020" / "state.json").read_text())
    per_step = 1024 // 128
    # 20 steps trained, plus the batches skipped by the rollbacks
    assert state["step"] == 20 and state["data"]["consumed_samples"] > 20 * per_step
