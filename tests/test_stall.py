"""The stall watchdog (``liveness/watchdog.py``, ``train.stall_timeout_s``) on real 2-rank gloo runs:
a run whose every rank hangs outside a collective is ended for a restart; a slow run that keeps
making progress is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from conftest import REPO, env, read_metrics, torchrun_argv, write_tiny_config

pytestmark = pytest.mark.slow

SEAMS = os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])


def test_a_run_whose_every_rank_hangs_in_a_data_read_is_ended_for_a_restart(tmp_path):
    """Every rank stuck in the data read of step 3 (a dead network mount): no collective is waiting,
    so train.collective_timeout_s never fired and the run hung for good. Now each rank's watchdog
    names the phase in one line, dumps the stacks, rank 0 writes exit_status.json (reason
    ``stalled``, which launchers restart) and the job ends; the checkpoint of step 2 stays usable."""
    from checkpointing.folders import verify

    cfg = write_tiny_config(tmp_path, steps=100, global_batch_tokens=512)  # one micro-batch per step
    out = tmp_path / "out"
    args = ["--config", str(cfg), "--train.stall_timeout_s=4", "--checkpoint.every=2"]
    proc = subprocess.Popen(
        torchrun_argv(2, *args),
        cwd=REPO,
        env=env(PYTHONPATH=SEAMS, PLAIT_TEST_HANG_DATA_AT_STEP="3"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not ((out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 2):  # step 3's read hangs from here
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else "no step 2"
            time.sleep(0.1)
        hung_at = time.time()
        output, _ = proc.communicate(timeout=60)
        ended_after = time.time() - hung_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and ended_after < 4 + 20, (proc.returncode, ended_after, output[-3000:])
    lines = [line for line in output.splitlines() if line.startswith("plait: error: rank") and ": stalled: no progress for" in line]
    assert lines and all(sum(f"rank {r}: stalled" in line for line in lines) <= 1 for r in (0, 1)), output[-3000:]
    assert "reading the data of step 3" in lines[0] and "train.stall_timeout_s = 4" in lines[0], lines
    assert "in _hanging_check_step" in output and "Thread 0x" in output, output[-3000:]  # faulthandler's dump: where it hung
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "stalled" and status["exit_code"] == 1 and status["step"] == 2, status
    assert "reading the data of step 3" in status["detail"]
    assert verify(out / "checkpoints" / "step_000000002")["step"] == 2  # shards and checksums included


def test_a_slow_run_that_keeps_making_progress_is_not_ended(tmp_path):
    """Each micro-batch read takes 60% of the timeout, and a validation pass of two of them takes
    longer than the timeout in all; the final save's writes (about 1,000 to 2,000 small blocks per rank)
    take 3 s, longer than the timeout too. Each batch and each block written is progress, so the run
    completes."""
    cfg = write_tiny_config(tmp_path, steps=2, global_batch_tokens=512, body="[validation]\nevery = 2\nbatches = 2\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        torchrun_argv(2, "--config", str(cfg), "--train.stall_timeout_s=2", "--checkpoint.every=0"),
        cwd=REPO,
        env=env(PYTHONPATH=SEAMS, PLAIT_TEST_SLOW_READ_S="1.2", PLAIT_TEST_SLOW_WRITE_S="3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and ": stalled: no progress" not in output, output[-3000:]
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "completed" and status["step"] == 2, status
    assert [r["step"] for r in read_metrics(out, "val")] == [2] and (out / "checkpoints" / "step_000000002" / "COMMITTED").exists()


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_stall_timeout_that_is_not_a_finite_non_negative_number_is_bad_input(value):
    from core.errors import ConfigError
    from preflight.option_values import build_options
    from preflight.run_config import TrainOptions

    with pytest.raises(ConfigError, match=r"\[train\]\.stall_timeout_s"):
        build_options(TrainOptions, {"steps": 1, "stall_timeout_s": value}, "run.toml: [train]")
