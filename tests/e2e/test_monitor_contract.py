"""Monitors over real runs: ``plait_train_end`` hears of a crash and exit_status.json says ``error``, and
the spikes monitor's window survives a resume."""

from __future__ import annotations

import json
import os

from conftest import REPO, read_metrics, run_module

SEAMS = REPO / "tests" / "seams"


def test_train_end_hears_of_a_crash_and_exit_status_says_error(tiny_config, tmp_path):
    cfg = tiny_config(steps=10)
    out = tmp_path / "out"
    r = run_module("core.train", "--config", str(cfg), extra_env={"PYTHONPATH": os.pathsep.join([str(SEAMS), str(REPO)]), "PLAIT_TEST_CRASH_AT_STEP": "4"})
    assert r.returncode == 1 and "planted crash" in r.stderr
    ends = [row for row in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if row.get("kind") == "end"]
    assert ends and ends[-1]["reason"] == "error"
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "error" and status["exit_code"] == 1 and "planted crash" in status["detail"]


def test_spikes_window_survives_resume(tiny_config, tmp_path):
    cfg = tiny_config(steps=12)
    out = tmp_path / "out"
    common = [
        "--config",
        str(cfg),
        '--monitors.enabled=["jsonl", "spikes"]',
        "--monitors.spikes.window=5",
        "--monitors.spikes.min_steps=3",
        "--monitors.spikes.action=log",
    ]
    assert run_module("core.train", *common, "--train.steps=6").returncode == 0
    state = json.loads((out / "checkpoints" / "step_000000006" / "state.json").read_text())
    window = state["train"]["spikes_window"]
    assert len(window["loss"]) == 5 and len(window["grad_norm"]) == 5
    # resumed with a spike at once: detected only if the window came back (min_steps 3 > 0 steps seen)
    rehearse = ['--monitors.enabled=["jsonl", "spikes", "spike_rehearsal"]', "--monitors.spike_rehearsal.at_step=7"]
    r = run_module("core.train", *common, "--train.steps=8", *rehearse)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "spikes: step 7: spike in" in r.stderr
    assert read_metrics(out)[-1]["step"] == 8
