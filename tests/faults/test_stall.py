"""The stall watchdog (``core/runtime/watchdog.py``, ``train.stall_timeout_s``) on real 2-rank gloo runs:
a run with a rank that hangs outside a collective is ended for a restart, every rank naming the one
that holds the others up; a slow run that keeps making progress is left alone; a hang in teardown,
after the run's end is recorded, ends the process but keeps that record."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from conftest import PY, REPO, env, read_metrics, torchrun_argv, write_tiny_config

pytestmark = pytest.mark.slow

SEAMS = os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])


def test_a_rank_that_hangs_in_a_data_read_is_named_by_every_rank_and_the_run_is_ended_for_a_restart(tmp_path):
    """Rank 1 alone is stuck in the data read of step 3 (a dead network mount); rank 0 waits for it in
    the step's gradient all-reduce. Each rank's watchdog names its own phase and, from every rank's
    phase in the rendezvous store, the rank holding the others up: both lines say rank 1 and its
    data read. Every thread's stack follows, rank 0 writes exit_status.json (reason ``stalled``, which
    launchers restart) and the job ends; the checkpoint of step 2 stays usable."""
    from core.checkpoint.folders import verify

    cfg = write_tiny_config(tmp_path, steps=100, global_batch_tokens=512)  # one micro-batch per step
    out = tmp_path / "out"
    args = ["--config", str(cfg), "--train.stall_timeout_s=8", "--checkpoint.every=2"]
    started = time.time()
    proc = subprocess.Popen(
        torchrun_argv(2, *args),
        cwd=REPO,
        env=env(PYTHONPATH=SEAMS, PLAIT_TEST_HANG_DATA_AT_STEP="3", PLAIT_TEST_HANG_DATA_ON_RANK="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 600  # a wait on the file, long only where the machine is loaded
        while not ((out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 2):  # step 3's read hangs from here
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else "no step 2"
            time.sleep(0.1)
        hung_at = time.time()
        output, _ = proc.communicate(timeout=600)
        ended_after = time.time() - hung_at
    finally:
        if proc.poll() is None:
            proc.kill()
    # ended by the watchdog (its timeout, then the lines, the stacks and the teardown, which take no longer
    # than starting the job and its first two steps took on this machine), not by a collective's timeout
    assert proc.returncode != 0 and ended_after < 8 + 20 + (hung_at - started), (proc.returncode, ended_after, output[-3000:])
    lines = {r: [line for line in output.splitlines() if line.startswith(f"plait: error: rank {r}: stalled: ")] for r in (0, 1)}
    assert all(len(found) == 1 for found in lines.values()), output[-4000:]  # one line per rank: torchrun's summary repeats it
    line0, line1 = lines[0][0], lines[1][0]
    assert "no progress for" in line1 and "reading the data of step 3 for" in line1 and "train.stall_timeout_s = 8" in line1, line1
    assert "the rank furthest behind is rank 1 (this rank): reading the data of step 3" in line1, line1
    assert "rank 0 in step 3 (forward, backward, update)" in line1, line1  # what the other rank does
    assert "in step 3 (forward, backward, update) for" in line0, line0  # rank 0's own phase: it waits in the step
    assert "the rank furthest behind is rank 1: reading the data of step 3" in line0, line0
    assert "in _hanging_check_step" in output and "Thread 0x" in output, output[-3000:]  # faulthandler's dump: where it hung
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "stalled" and status["exit_code"] == 1 and status["step"] == 2, status
    assert "the rank furthest behind is rank 1" in status["detail"]
    assert verify(out / "checkpoints" / "step_000000002")["step"] == 2  # shards and checksums included


def test_a_slow_run_that_keeps_making_progress_is_not_ended(tmp_path):
    """Each micro-batch read takes 60% of the timeout, and a validation pass of two of them takes
    longer than the timeout in all; the final save's writes (about 1,000 to 2,000 small blocks per rank)
    take 6 s, longer than the timeout too. Each batch and each block written is progress, so the run
    completes. The timeout (4 s) leaves 1.6 s around each read for the step's own work on a loaded machine."""
    cfg = write_tiny_config(tmp_path, steps=2, global_batch_tokens=512, body="[validation]\nevery = 2\nbatches = 2\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        torchrun_argv(2, "--config", str(cfg), "--train.stall_timeout_s=4", "--checkpoint.every=0"),
        cwd=REPO,
        env=env(PYTHONPATH=SEAMS, PLAIT_TEST_SLOW_READ_S="2.4", PLAIT_TEST_SLOW_WRITE_S="6"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and ": stalled: no progress" not in output, output[-3000:]
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "completed" and status["step"] == 2, status
    assert [r["step"] for r in read_metrics(out, "val")] == [2] and (out / "checkpoints" / "step_000000002" / "COMMITTED").exists()


def test_a_hang_in_teardown_after_a_completed_run_ends_the_process_and_keeps_completed(tmp_path):
    """The run completed (exit_status.json says so, its last checkpoint is committed), then destroying
    the process groups never returns. The watchdog watches until the process exits: one line naming the teardown phase,
    the stacks, and the end of the process, while exit_status.json keeps ``completed`` (a launcher
    does not restart a finished run). One process: the teardown is the same on every rank. The timeout
    (20 s, 60 s until the first step ends) leaves a loaded machine room to build and train: at 5 s, a
    start whose fsync waited behind other processes' writes for 15 s was ended as stalled."""
    cfg = write_tiny_config(tmp_path, steps=2, global_batch_tokens=256)
    out = tmp_path / "out"
    proc = subprocess.run(
        [PY, "-m", "core.train", "--config", str(cfg), "--train.stall_timeout_s=20", "--checkpoint.every=0"],
        cwd=REPO,
        env=env(PYTHONPATH=SEAMS, PLAIT_TEST_HANG_AT_EXIT="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    err = proc.stderr
    assert proc.returncode == 1, (proc.returncode, err[-3000:])
    assert "plait: error: rank 0: stalled: no progress for" in err and "after the run's end: destroying the process groups" in err, err[-3000:]
    assert "exit_status.json keeps reason 'completed'" in err and "in _hanging_shutdown" in err, err[-3000:]
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "completed" and status["exit_code"] == 0 and status["step"] == 2, status
    assert (out / "checkpoints" / "step_000000002" / "COMMITTED").exists()
