"""launchers/remote.sh end to end on CPU: runs, and after a SIGKILL restarts and resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, env, read_metrics

pytestmark = pytest.mark.slow


def remote_env(tmp_path, **extra):
    e = env(PYTHON=sys.executable, OUTPUT_DIR=str(tmp_path / "out"), NPROC="2", BACKOFF_S="1", **extra)
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e["PATH"]
    return e


def small_args(tiny_config, steps):
    return [
        "--train.steps=%d" % steps,
        "--model.dim=64",
        "--data.seq_len=128",
        "--train.global_batch_tokens=1024",
        "--train.micro_batch=2",
        "--train.log_every=1",
        '--monitors.enabled=["console", "jsonl"]',
    ]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for child in Path("/proc").glob("[0-9]*"):
            try:
                if int((child / "stat").read_text().rsplit(")", 1)[1].split()[1]) == p:
                    out.append(int(child.name))
                    todo.append(int(child.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def test_remote_runs_debug_config(tiny_config, tmp_path):
    proc = subprocess.run(
        ["bash", "launchers/remote.sh", *small_args(tiny_config, 4)],
        cwd=REPO,
        env=remote_env(tmp_path, CKPT_EVERY="2", LR="0.002"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch " in proc.stdout and "torchao" in proc.stdout
    rows = read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    resolved = (tmp_path / "out" / "config.resolved.toml").read_text()
    assert "lr = 0.002" in resolved and "every = 2" in resolved
    assert (tmp_path / "out" / "remote.log").stat().st_size > 0


def test_remote_restarts_after_sigkill_and_resumes(tiny_config, tmp_path):
    proc = subprocess.Popen(
        # exclude_from_loading shapes the first start only: a restart resumes its own checkpoint whole
        ["bash", "launchers/remote.sh", *small_args(tiny_config, 400), '--checkpoint.exclude_from_loading=["train", "optimizer"]'],
        cwd=REPO,
        env=remote_env(tmp_path, CKPT_EVERY="5", RESUME="none"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ckpts = tmp_path / "out" / "checkpoints"
    deadline = time.time() + 180
    while time.time() < deadline and not any((p / "COMMITTED").exists() for p in ckpts.glob("step_*")):
        time.sleep(0.3)
    trainers = [
        p
        for p in descendants(proc.pid)
        if "core.train" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
        and "torch.distributed.run" not in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
    ]
    assert trainers, "no trainer process found"
    for p in trainers:
        os.kill(p, signal.SIGKILL)
    # let it restart and resume, then stop it cleanly
    deadline = time.time() + 180
    log = tmp_path / "out" / "remote.log"
    while time.time() < deadline and "restored tokens seen" not in log.read_text():
        time.sleep(0.3)
    assert "trainer died" in log.read_text() and "resumed from" in log.read_text()
    assert "optimizer started fresh" not in log.read_text() and "not restored" not in log.read_text()
    # RESUME is the first attempt's only: the restart resumes with "auto"
    assert "attempt 1, 2 processes, checkpoint.resume=none" in log.read_text()
    assert "attempt 2, 2 processes, checkpoint.resume=auto" in log.read_text()
    for p in descendants(proc.pid):
        cmd = Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace") if Path(f"/proc/{p}").exists() else ""
        if "core.train" in cmd and "torch.distributed.run" not in cmd:
            os.kill(p, signal.SIGTERM)
    proc.communicate(timeout=120)
    status = json.loads((tmp_path / "out" / "exit_status.json").read_text())
    assert status["reason"] == "signal" and proc.returncode == 0
    steps = [r["step"] for r in read_metrics(tmp_path / "out")]
    assert steps[-1] == status["step"]


def test_remote_bad_config_is_not_retried(tmp_path):
    proc = subprocess.run(["bash", "launchers/remote.sh", "--optimizer.lrr=1"], cwd=REPO, env=remote_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown key 'lrr'" in proc.stdout + proc.stderr
    assert "attempt" not in proc.stderr


def test_k8s_entrypoint_passes_the_trainers_exit_code(tiny_config, tmp_path):
    """torchrun reports 1 for any failure; the pod must exit with the trainer's own code so the
    Job's podFailurePolicy can refuse to retry bad input and diverged runs."""
    from conftest import free_port

    cfg = tiny_config(steps=8)
    env = dict(os.environ, PY=sys.executable, NNODES="1", NPROC_PER_NODE="2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", OMP_NUM_THREADS="1")
    script = str(REPO / "launchers" / "k8s" / "entrypoint.sh")
    bad = subprocess.run(["bash", script, str(cfg), "--optimizer.lr=-1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stderr[-2000:]
    diverged = subprocess.run(
        ["bash", script, str(cfg), "--optimizer.lr=1e6", "--train.max_nonfinite_steps=0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert diverged.returncode == 3, diverged.stderr[-3000:]
