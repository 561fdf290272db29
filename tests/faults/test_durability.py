"""Durability: non-finite values never reach weights or checkpoints, pruning only touches the
run's own verified checkpoints, one writer per run folder, ranks die with their launcher.

Real DCP checkpoints, real files, real torchrun; the in-process tests build plait's own
Trainer on one CPU process (no process group is mocked: one process has none).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, env, run_module, torchrun_argv, torchrun_script, write_tiny_config
from shared import ckpt_dirs, committed_steps, nonfinite_tensors

pytestmark = pytest.mark.slow


def test_huge_learning_rate_never_writes_a_poisoned_checkpoint(tmp_path):
    """The reported case: lr 1e6 with a save every step once wrote NaN weights, and auto-resume
    then failed at once, forever."""
    cfg = write_tiny_config(tmp_path, steps=12)
    out = tmp_path / "out"
    r = run_module(
        "core.train", "--config", str(cfg), "--optimizer.lr=1e6", "--checkpoint.every=1", "--checkpoint.keep_latest=0", "--train.max_nonfinite_steps=0"
    )
    assert r.returncode == 3, r.stderr[-2000:]
    assert json.loads((out / "exit_status.json").read_text())["exit_code"] == 3
    for name in committed_steps(out):
        assert nonfinite_tensors(out / "checkpoints" / name) == 0, name


# --- lineage and pruning --------------------------------------------------------------


def test_fresh_run_refuses_a_folder_holding_another_runs_checkpoints(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=6)
    out = tmp_path / "out"
    assert run_module("core.train", "--config", str(cfg), "--checkpoint.every=3").returncode == 0
    before = committed_steps(out)
    r = run_module("core.train", "--config", str(cfg), "--checkpoint.resume=none", "--train.steps=2")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "another run" in lines[0] and "allow_foreign" in lines[0], r.stderr
    # explicitly allowed: the new run keeps its own final checkpoint and never touches the old run's
    r = run_module(
        "core.train",
        "--config",
        str(cfg),
        "--checkpoint.resume=none",
        "--train.steps=2",
        "--checkpoint.allow_foreign=true",
        "--checkpoint.every=1",
        "--checkpoint.keep_latest=1",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert committed_steps(out) == sorted(before + ["step_000000002"])


# --- one writer, and no orphans -------------------------------------------------------

HOLDER = """
import sys, time
from core.runtime.ownership import lock_run_folders
lock_run_folders([sys.argv[1]])
print("locked", flush=True)
time.sleep(600)
"""


def test_second_job_on_a_locked_folder_exits_2_naming_the_holder(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=2)
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], cwd=REPO, env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        for module in ("core.train", "core.plan"):
            r = run_module(module, "--config", str(cfg))
            assert r.returncode == 2, (module, r.stderr)
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and f"pid {holder.pid}" in lines[0] and "in use" in lines[0], r.stderr
        assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    finally:
        holder.kill()
        holder.wait()
    r = run_module("core.train", "--config", str(cfg))  # the lock died with its holder
    assert r.returncode == 0, r.stderr[-2000:]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_ranks_die_with_a_killed_launcher(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=100_000)
    out = tmp_path / "out"
    cmd = torchrun_argv(2, "--config", str(cfg), "--checkpoint.every=2", "--train.log_every=1")
    launcher = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and not committed_steps(out):
        time.sleep(0.2)
    ranks = _children(launcher.pid)
    assert len(ranks) == 2 and committed_steps(out), "the job never trained"
    launcher.send_signal(signal.SIGKILL)  # what `kill -9` of the launcher's process group reaches
    launcher.wait()
    deadline = time.time() + 20
    while time.time() < deadline and any(Path(f"/proc/{r}").exists() and "Z" not in _state(r) for r in ranks):
        time.sleep(0.2)
    alive = [r for r in ranks if Path(f"/proc/{r}").exists() and "Z" not in _state(r)]
    assert not alive, f"ranks {alive} outlived their launcher"
    written = ckpt_dirs(out)
    time.sleep(2)
    assert ckpt_dirs(out) == written  # nothing writes after the launcher is gone
    r = run_module("core.train", "--config", str(cfg), "--train.steps=" + str(int(committed_steps(out)[-1][5:]) + 1))
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-2000:]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def test_a_nonfinite_loss_on_one_rank_skips_the_step_on_both(tmp_path):
    out = tmp_path / "guard.json"
    r = torchrun_script(2, REPO / "tests" / "workers" / "guard_ranks.py", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["flags"] == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]  # rank 0's own loss was finite throughout
    assert got["changed"] == [True, True, False, False, True, True]
    assert got["counters"] == [2, 2, 0] and got["ranks_equal"]


def test_a_full_disk_while_writing_exit_status_leaves_the_old_file_whole(tmp_path):
    """exit_status.json is what a launcher reads to decide on a restart: a write that fails half way
    (here a file-size limit, EFBIG, as a full disk gives ENOSPC) keeps the previous file, never a
    truncated one; the failure is one logged line."""
    import resource

    old = {"exit_code": 0, "reason": "completed", "step": 8, "detail": ""}
    (tmp_path / "exit_status.json").write_text(json.dumps(old) + "\n")
    code = (
        "import sys; from pathlib import Path; from core.preflight.run_files import write_exit_status; "
        f"write_exit_status(Path({str(tmp_path)!r}), 74, 'save_failed', 9, 'x' * 4096, strict=False)"
    )

    def limit() -> None:  # 64 bytes per file, for the child only
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))

    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(), capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cannot write exit_status.json" in proc.stderr, proc.stderr[-2000:]
    assert json.loads((tmp_path / "exit_status.json").read_text()) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exit_status.json"]  # no partial copy left beside it
