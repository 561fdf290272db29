"""The budget guard over real runs: a warning alerts once and the run goes on, a hanging alert command
holds nothing, projected over the cap checkpoints and exits 75, spent over the cap exits 76 without a
checkpoint, two ranks follow rank 0, and the pre-flight refuses a run over the cap unless forced."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import REPO, read_metrics, run_module, torchrun
from shared import budget_file


@pytest.fixture
def guarded(tiny_config, tmp_path):
    clock = tmp_path / "clock"
    clock.write_text("1800000000")
    cfg = tiny_config(
        steps=4,
        body=(
            f'[monitors.budget_guard]\nbudget_file = "{tmp_path / "budget.json"}"\nwarn_usd = 30.0\ncap_usd = 35.0\n'
            f'check_every_s = 0.0\nalert_command = "touch {tmp_path / "alerted"}"\n'
        ),
    )
    args = ("--config", str(cfg), '--monitors.enabled=["console", "jsonl", "budget_guard"]')
    return args, {"PLAIT_TEST_CLOCK_FILE": str(clock), "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])}, tmp_path


def committed(out):
    return sorted(p.name for p in (out / "checkpoints").glob("step_*") if (p / "COMMITTED").exists())


def status(out):
    return json.loads((out / "exit_status.json").read_text())


def test_warn_alerts_once_and_runs_on(guarded):
    args, env, tmp = guarded
    budget_file(tmp / "budget.json", spent=31, projected=33)
    proc = run_module("core.train", *args, extra_env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("budget_guard: alert: spent $31.00 > warn $30.00") == 1
    assert (tmp / "alerted").exists()
    assert len(read_metrics(tmp / "out")) == 4


def test_a_hanging_alert_command_holds_neither_the_run_nor_its_output(guarded):
    """An alert_command that hangs (a webhook that never answers), or a child it leaves behind, never
    keeps the pipe into remote.sh's ``tee`` (here this test's pipes) open after the run ended: the
    command runs in a session of its own with its output read by the guard, and is ended, with what it started, after
    alert_timeout_s (or a few seconds after the run's end), with one warning."""
    args, env, tmp = guarded
    budget_file(tmp / "budget.json", spent=31, projected=33)
    pid_file = tmp / "sleep.pid"
    hold_s = 900  # what the command's child would hold the run for: the run ends long before (a ratio, not a limit)
    command = f"touch {tmp / 'alerted'}; sleep {hold_s} & echo $! > {pid_file}; wait"
    t0 = time.time()
    proc = run_module(
        "core.train",
        *args,
        f"--monitors.budget_guard.alert_command={json.dumps(command)}",
        "--monitors.budget_guard.alert_timeout_s=1",
        extra_env=env,
        timeout=hold_s * 2 / 3,
    )
    assert proc.returncode == 0 and time.time() - t0 < hold_s / 2, proc.stderr[-2000:]
    assert (tmp / "alerted").exists() and proc.stderr.count("budget_guard: alert_command") == 1, proc.stderr[-2000:]
    assert "ended it and what it started" in proc.stderr
    sleeper = Path(f"/proc/{pid_file.read_text().strip()}/stat")
    deadline = time.time() + 60  # a wait on the process's state: long only on a loaded machine
    while sleeper.exists() and sleeper.read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.time() < deadline:
        time.sleep(0.1)
    assert not sleeper.exists() or sleeper.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the command's child still runs"


def test_projected_over_cap_checkpoints_and_exits_75(guarded):
    args, env, tmp = guarded
    budget_file(tmp / "budget.json", spent=20, projected=40)
    proc = run_module("core.train", *args, extra_env=env)
    assert proc.returncode == 75, proc.stderr[-2000:]
    assert committed(tmp / "out") == ["step_000000001"]
    assert status(tmp / "out")["exit_code"] == 75


def test_spent_over_cap_exits_76_without_checkpoint(guarded):
    args, env, tmp = guarded
    budget_file(tmp / "budget.json", spent=36, projected=40)
    proc = run_module("core.train", *args, extra_env=env)
    assert proc.returncode == 76
    assert committed(tmp / "out") == []


@pytest.mark.slow
def test_two_ranks_follow_rank_zero(guarded):
    args, env, tmp = guarded
    budget_file(tmp / "budget.json", spent=20, projected=40)
    proc = torchrun(2, *args, extra_env=env)
    assert proc.returncode != 0  # torchrun reports a non-zero child as failure
    assert status(tmp / "out")["exit_code"] == 75 and committed(tmp / "out") == ["step_000000001"]


def test_preflight_refuses_over_cap_unless_forced(guarded):
    args, env, tmp = guarded
    budget_file(tmp / "budget.json", spent=0, projected=0)
    slow = ("--monitors.budget_guard.rate_usd_per_hr=10.0", "--monitors.budget_guard.expected_tokens_per_s=0.1")
    proc = run_module("core.train", *args, *slow, extra_env=env)
    assert proc.returncode == 2 and "over cap_usd = 35.0; pass --budget.force=true" in proc.stderr
    proc = run_module("core.train", *args, *slow, "--budget.force=true", extra_env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
