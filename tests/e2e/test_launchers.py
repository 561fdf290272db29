"""launchers/remote.sh end to end on CPU: runs, and after a SIGKILL restarts and resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import REPO, env, in_a_small_disk, read_metrics, torchrun_argv, write_tiny_config
from shared import remote_env, small_args

pytestmark = pytest.mark.slow


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
        # the budget guard's computed spend: billed from when the launcher began holding the machine
        [
            "bash",
            "launchers/remote.sh",
            *small_args(4),
            '--monitors.enabled=["console", "jsonl", "budget_guard"]',
            "--monitors.budget_guard.rate_usd_per_hr=1.0",
        ],
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
    ledger = json.loads((tmp_path / "out" / "budget_ledger.json").read_text())
    assert ledger["launcher"].split()[0] == Path("/proc/sys/kernel/random/boot_id").read_text().strip() and ledger["billed_s"] > 0
    info = json.loads((tmp_path / "out" / "run_info.json").read_text())  # what remote.sh reads an attempt's progress from
    assert info["checkpoint_dir"] == str(tmp_path / "out" / "checkpoints")


def test_remote_restarts_after_sigkill_and_resumes(tiny_config, tmp_path):
    proc = subprocess.Popen(
        # exclude_from_loading shapes the first start only: a restart resumes its own checkpoint whole
        ["bash", "launchers/remote.sh", *small_args(400), '--checkpoint.exclude_from_loading=["train", "optimizer"]'],
        cwd=REPO,
        env=remote_env(tmp_path, CKPT_EVERY="5", RESUME="none"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ckpts = tmp_path / "out" / "checkpoints"
    deadline = time.time() + 600
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
    deadline = time.time() + 600
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


def test_an_interpreter_without_plait_is_one_line_naming_it_and_the_way_out(tmp_path):
    """The README installs into .venv without activating it; remote.sh's default PYTHON is `python` on
    the PATH, which then lacks torch. Not a traceback nor "is plait installed?" (it is, in .venv): the
    line names the interpreter, its error and PYTHON=.venv/bin/python."""
    bare = tmp_path / "bin" / "python"
    bare.parent.mkdir()
    bare.write_text(f'#!/bin/bash\nexec {sys.executable} -I -S "$@"\n')  # no site-packages: no torch, no plait
    bare.chmod(0o755)
    proc = subprocess.run(["bash", "launchers/remote.sh"], cwd=REPO, env=remote_env(tmp_path, PYTHON=str(bare)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "attempt" not in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert f"PYTHON={bare} failed (ModuleNotFoundError: No module named 'torch')" in line and "PYTHON=.venv/bin/python" in line
    assert "Traceback" in (tmp_path / "out" / "remote.log").read_text()  # the whole error stays in the log


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


def default_signals() -> None:
    """The child's SIGINT/SIGHUP as a terminal's shell leaves them (a test runner started in the
    background ignores SIGINT, and bash cannot trap a signal ignored when it starts)."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def start_remote(tmp_path, steps, **extra):
    return subprocess.Popen(
        ["bash", "launchers/remote.sh", *small_args(steps)],
        cwd=REPO,
        env=remote_env(tmp_path, **extra),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=default_signals,
    )


@contextmanager
def running_remote(tmp_path, steps, **extra):
    """``start_remote``; whatever is left of it (its process group) is SIGKILLed on the way out."""
    proc = start_remote(tmp_path, steps, **extra)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def wait_for_log(proc, log: Path, text: str, timeout: float = 600) -> None:
    """Until ``text`` is in ``log``; the limit is for a hung launcher only (a loaded CI machine is slow)."""
    deadline = time.time() + timeout
    while time.time() < deadline and not (log.exists() and text in log.read_text()):
        assert proc.poll() is None, f"remote.sh ended early ({proc.returncode}): {log.read_text()[-2000:] if log.exists() else ''}"
        time.sleep(0.2)
    assert text in log.read_text(), f"no {text!r} after {timeout:.0f} s: {log.read_text()[-2000:]}"


def run_processes(named: Path) -> list[int]:
    """Live processes whose command line names ``named`` (the run's output folder or config: torchrun, ranks)."""
    found = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if str(named) in (p / "cmdline").read_bytes().decode(errors="replace") and (p / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(p.name))
        except (OSError, IndexError):
            continue
    return found


@pytest.mark.parametrize("to", ["process group", pytest.param("launcher alone", marks=pytest.mark.bench), "launcher killed"])  # CI time
def test_a_signal_to_remote_sh_stops_the_run_once_with_a_checkpoint(tmp_path, to):
    """Ctrl-C in the launcher's terminal (SIGINT to its whole process group) killed its ``tee``,
    the trainer died of the broken pipe without the stop's checkpoint, and the launcher took
    that for a crash and restarted the run the user had stopped. SIGTERM to the launcher alone
    (``kill <pid>``, a container's PID 1) killed bash and left torchrun training as an orphan.
    Now both stop the trainer at a step boundary with a checkpoint, the log keeps its last
    lines, nothing is restarted, and no process of the run is left. A launcher SIGKILLed (the OOM
    killer, ``kill -9``) leaves torchrun a SIGTERM (PR_SET_PDEATHSIG): the same clean stop."""
    out = tmp_path / "out"
    proc = start_remote(tmp_path, 100000, CKPT_EVERY="1000", MAX_RESTARTS="2")
    try:
        wait_for_log(proc, out / "remote.log", "step 3/")
        if to == "process group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGKILL if to == "launcher killed" else signal.SIGTERM)
        proc.wait(timeout=90)
        deadline = time.time() + 90
        while time.time() < deadline and run_processes(out):  # after a SIGKILL nobody waits for torchrun
            time.sleep(0.2)
    finally:
        for p in run_processes(out):
            os.kill(p, signal.SIGKILL)
    log = (out / "remote.log").read_text()
    status = json.loads((out / "exit_status.json").read_text())
    assert proc.returncode == (-9 if to == "launcher killed" else 0) and status["reason"] == "signal", (proc.returncode, status, log[-3000:])
    assert (out / "checkpoints" / f"step_{status['step']:09d}" / "COMMITTED").exists()
    assert f"training ended at step {status['step']} (signal)" in log  # the trainer's last lines reached the log
    assert log.count("starting (attempt") == 1 and ("not restarted" in log or to == "launcher killed")


def test_the_back_off_holds_the_folder_and_a_signal_there_ends_remote_sh_at_once(tmp_path):
    """While a launcher waits to restart a crashed trainer, no trainer holds the run folder's lock:
    the first launcher holds a lock of its own for its whole life, so a second launcher on the same
    OUTPUT_DIR exits 2 naming it. A stop asked during the back-off does not wait out the ``sleep``:
    the launcher leaves at once with 128 + the signal's number, starting nothing."""
    out = tmp_path / "out"
    seams = str(REPO / "tests" / "seams")
    with running_remote(tmp_path, 20, BACKOFF_S="120", PLAIT_TEST_CRASH_AT_STEP="2", PYTHONPATH=seams) as proc:
        wait_for_log(proc, out / "remote.log", "restarting in 120s")
        second = subprocess.run(
            ["bash", "launchers/remote.sh", *small_args(2)], cwd=REPO, env=remote_env(tmp_path), capture_output=True, text=True, timeout=300
        )
        assert second.returncode == 2 and f"in use by another launcher (pid {proc.pid} on" in second.stderr, second.stderr[-2000:]
        t0 = time.time()
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=100)
    log = (out / "remote.log").read_text()
    assert proc.returncode == 143 and time.time() - t0 < 60, (proc.returncode, log[-2000:])  # the back-off is 120 s
    assert log.count("starting (attempt") == 1 and "stopped by a signal" in log


@pytest.mark.bench  # a save held for seconds on purpose, then two Ctrl-Cs: `pytest -m bench`
def test_a_second_ctrl_c_to_remote_sh_still_stops_at_once(tmp_path):
    """torchrun runs in a process group of its own under the launcher, so the terminal's Ctrl-C
    does not reach it or the ranks: the launcher forwards the first, and sends a deliberate
    second one (after the 3 s window) to the ranks themselves, which stop at once, as they do
    under torchrun in a terminal. Here the first lands while the save of step 4 hangs before its
    commit; the second ends the run without that checkpoint and without a restart."""
    out = tmp_path / "out"
    seams = str(REPO / "tests" / "seams")
    with running_remote(tmp_path, 100000, CKPT_EVERY="4", PYTHONPATH=seams, PLAIT_TEST_PAUSE_BEFORE_COMMIT="4:90") as proc:
        wait_for_log(proc, out / "remote.log", "step 4/")
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(4)
        t0 = time.time()
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    log = (out / "remote.log").read_text()
    assert time.time() - t0 < 40 and proc.returncode != 0, log[-2000:]
    assert not (out / "checkpoints" / "step_000000004" / "COMMITTED").exists()
    assert log.count("starting (attempt") == 1 and run_processes(out) == []


def test_k8s_entrypoint_forwards_sigterm_and_never_reports_a_stop_as_done(tiny_config, tmp_path):
    """The kubelet's SIGTERM (eviction, pre-emption) reaches the entrypoint alone, PID 1 of the
    container, where bash would ignore it. The signal is forwarded to torchrun (a checkpoint of the step it
    stopped at), the stopped pod exits 143, and a pod never reports an earlier pod's status."""
    from conftest import free_port

    cfg = tiny_config(steps=100000)
    out = tmp_path / "out"
    script = str(REPO / "launchers" / "k8s" / "entrypoint.sh")

    def pod(*args: str) -> subprocess.Popen:
        e = dict(os.environ, PY=sys.executable, NNODES="1", NPROC_PER_NODE="2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", OMP_NUM_THREADS="1")
        return subprocess.Popen(
            ["bash", script, str(cfg), *args],
            cwd=REPO,
            env=e,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=default_signals,
        )

    def wait_for_step(proc, step: int) -> None:
        deadline = time.time() + 120
        while time.time() < deadline and not ((out / "metrics.jsonl").exists() and any(r["step"] >= step for r in read_metrics(out))):
            assert proc.poll() is None, f"the pod ended early with {proc.returncode}"
            time.sleep(0.2)

    proc = pod()
    try:
        wait_for_step(proc, 3)
        os.kill(proc.pid, signal.SIGTERM)  # the entrypoint alone, as the kubelet sends it
        proc.wait(timeout=90)
        status = json.loads((out / "exit_status.json").read_text())
        assert proc.returncode == 143 and status["reason"] == "signal", (proc.returncode, status)
        assert (out / "checkpoints" / f"step_{status['step']:09d}" / "COMMITTED").exists() and run_processes(cfg) == []

        proc = pod()  # the next pod: its ranks are SIGKILLed (no exit_status.json of their own)
        wait_for_step(proc, status["step"] + 1)
        commands = {p: Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace") for p in run_processes(cfg)}
        ranks = [p for p, c in commands.items() if "core.train" in c and "torch.distributed.run" not in c]
        for p in ranks:
            os.kill(p, signal.SIGKILL)
        proc.wait(timeout=90)
        assert len(ranks) == 2 and proc.returncode not in (0, 143), (commands, proc.returncode)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_run_folder_taken_between_two_attempts_ends_remote_sh_with_exit_2(tmp_path):
    """Another job (a hand-started torchrun) takes this run's checkpoint folder after the
    launcher's checks and before its trainer locks it (as it can between two attempts): the
    trainer's rank 0 finds the folder in use and exits 2 without an exit_status.json (that folder's
    is the other job's). The launcher recognises the trainer's line and ends with exit 2, rather
    than restart into the same refusal as after a crash."""
    out = tmp_path / "out"
    go = tmp_path / "go"
    seams = str(REPO / "tests" / "seams")
    proc = start_remote(tmp_path, 20, MAX_RESTARTS="3", PLAIT_TEST_WAIT_BEFORE_LOCK=str(go), PYTHONPATH=seams)
    other = None
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not Path(f"{go}.ready").exists():  # the trainer is about to take its locks
            assert proc.poll() is None, (out / "remote.log").read_text()[-2000:]
            time.sleep(0.2)
        (tmp_path / "elsewhere").mkdir()
        cfg = write_tiny_config(tmp_path / "elsewhere", steps=100000)
        other = subprocess.Popen(
            torchrun_argv(2, "--config", str(cfg), f"--checkpoint.dir={out / 'checkpoints'}"),
            cwd=REPO,
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        from core.runtime.ownership import held_elsewhere

        while time.time() < deadline and not held_elsewhere(out / "checkpoints"):
            assert other.poll() is None, "the other job ended early"
            time.sleep(0.2)
        go.touch()
        proc.wait(timeout=90)
    finally:
        for p in (proc, other):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    log = (out / "remote.log").read_text()
    assert proc.returncode == 2 and "another job holds a run folder of this run; not restarting" in log, (proc.returncode, log[-3000:])
    assert log.count("starting (attempt") == 1


def test_slurm_plan_checks_the_resume_the_trainer_gets(tiny_config, tmp_path):
    """slurm.sbatch trains with ``--checkpoint.resume=auto`` but planned without it: with a config
    that says ``resume = "none"`` (a fresh start), a requeued job's plan found the run's own
    checkpoints, refused them as another run's and ended the job with exit 2 instead of resuming.
    srun and scontrol are stand-ins here (srun records what it would run); the plan is real."""
    cfg = tiny_config(body='[checkpoint]\nresume = "none"\n')
    saved = tmp_path / "out" / "checkpoints" / "step_000000004"  # what the job saved before it was requeued
    saved.mkdir(parents=True)
    (saved / "COMMITTED").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path / "srun.args"}"\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    e = dict(os.environ, SLURM_JOB_NODELIST="node1", SLURM_NNODES="1", SLURM_GPUS_PER_NODE="2", SLURM_JOB_ID="7", OMP_NUM_THREADS="1")
    e["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), e["PATH"]])
    proc = subprocess.run(["bash", "launchers/slurm.sbatch", str(cfg)], cwd=REPO, env=e, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--checkpoint.resume=auto" in (tmp_path / "srun.args").read_text().splitlines()


def test_the_back_off_doubles_up_to_300_s_and_never_overflows():
    """remote.sh's wait before restart N: BACKOFF_S doubled N times, at most 300 s. It was
    BACKOFF_S * (1 << N), which bash's 64-bit arithmetic overflows to a negative wait (sleep fails,
    the restart comes at once) for a large BACKOFF_S by the 4th restart, for any by the 63rd.
    The lines are run as remote.sh holds them."""
    lines = (REPO / "launchers" / "remote.sh").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("wait_s=$BACKOFF_S"))
    block = "\n".join(line.strip() for line in lines[start : start + 3])
    assert block.endswith("wait_s=300"), block
    for backoff, waits in [("10", [10, 20, 40, 80, 160, 300, 300]), ("0", [0] * 7), ("999999999999999999", [300] * 7)]:
        for attempt in [0, 1, 2, 3, 4, 5, 63]:
            script = f"BACKOFF_S={backoff}; stuck={attempt + 1}\n{block}\necho $wait_s"  # the attempt-th restart in a row
            got = int(subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout)
            assert got == waits[min(attempt, 6)], (backoff, attempt, got)


# A stand-in trainer (torchrun) for the launchers' restart logic: each attempt does what FAKE_ATTEMPTS says, in turn,
# and dies (exit 1): "progress" commits a newer checkpoint (a step_ folder with COMMITTED, as core/checkpoint/folders.py
# commits them), "uncommitted" leaves one without COMMITTED (a save killed before its commit), "stalled" writes
# the watchdog's exit_status.json, "diverged" the one of a run stopped as diverged (exit code 3), "disk_full" only
# prints rank 0's line of a save that failed (exit_status.json did not fit either), "outlived" has a rank that ends
# at once and then never ends itself (torchrun waiting on a lost node's store), "ended_in_barrier" too, once rank 0 has
# recorded a stop by a signal (torchrun in its exit barrier, waiting for a pre-empted node's agent), "stuck" does nothing. Each writes
# run_info.json as rank 0 does.
FAKE_TRAINER = """
import json, os, subprocess, sys, time
from pathlib import Path
out = Path(os.environ["OUTPUT_DIR"])
ckpts = out / "checkpoints"
count = out / "attempts"
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
what = os.environ["FAKE_ATTEMPTS"].split(",")[n]
(out / "run_info.json").write_text(json.dumps({"checkpoint_dir": str(ckpts)}))
newest = max([int(p.name[5:]) for p in ckpts.glob("step_*") if (p / "COMMITTED").exists()], default=0)
if what in ("progress", "uncommitted"):
    (ckpts / f"step_{newest + 5:09d}").mkdir(parents=True)
if what == "progress":
    (ckpts / f"step_{newest + 5:09d}" / "COMMITTED").write_text("{}")
if what == "stalled":
    (out / "exit_status.json").write_text(json.dumps({"exit_code": 1, "reason": "stalled", "step": newest, "detail": "no progress"}))
if what == "diverged":
    (out / "exit_status.json").write_text(json.dumps({"exit_code": 3, "reason": "diverged", "step": newest, "detail": "nan"}))
if what == "disk_full":
    print(f"plait: error: checkpoint save at step {newest + 5} failed on rank 0: OSError: [Errno 28] No space left on device", flush=True)
if what == "outlived":
    subprocess.run([sys.executable, "-c", "import time; time.sleep(2)"])
    time.sleep(600)
if what == "ended_in_barrier":
    subprocess.run([sys.executable, "-c", "import time; time.sleep(2)"])
    (out / "exit_status.json").write_text(json.dumps({"exit_code": 0, "reason": "signal", "step": newest, "detail": "SIGTERM"}))
    time.sleep(600)
sys.exit(1)
"""

# The launchers' python: the stand-in trainer for torchrun, nothing for the installation check, the output folder for
# core.plan (--json).
FAKE_PYTHON = """#!/bin/bash
case " $* " in
    *" torch.distributed.run "*) exec "$REAL_PY" "$FAKE_TRAINER" ;;
    *" core.plan "*) printf '{"output_dir": "%s"}\\n' "$OUTPUT_DIR"; exit 0 ;;
esac
if [ "$1" = - ]; then cat > /dev/null; echo "gpus 0"; exit 0; fi
exec "$REAL_PY" "$@"
"""


def test_max_restarts_counts_attempts_in_a_row_that_made_no_progress(tmp_path):
    """MAX_RESTARTS counted every restart of the launcher's life: a week-long run pre-empted now and
    then stopped restarting after the third, however far each attempt had trained. Now only attempts
    in a row that committed no newer checkpoint than they started from count (a save without its
    COMMITTED marker is none), an attempt that committed one starts the count again, and a stall
    (the watchdog's reason ``stalled``) is restarted like a crash."""
    (tmp_path / "trainer.py").write_text(FAKE_TRAINER)
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    e = remote_env(tmp_path, PYTHON=str(python), REAL_PY=sys.executable, FAKE_TRAINER=str(tmp_path / "trainer.py"), MAX_RESTARTS="1", BACKOFF_S="0")
    e["FAKE_ATTEMPTS"] = "stuck,progress,stalled,progress,uncommitted,stuck"
    proc = subprocess.run(["bash", "launchers/remote.sh"], cwd=REPO, env=e, capture_output=True, text=True, timeout=120)
    log = (tmp_path / "out" / "remote.log").read_text()
    assert proc.returncode == 1 and log.count("starting (attempt") == 6, (proc.returncode, log[-3000:])
    assert "trainer died (code 1; it committed step 5)" in log and "trainer died (code 1; it committed step 10)" in log
    assert "trainer died (code 1; no new checkpoint, 1 in a row)" in log
    assert "2 attempts in a row committed no new checkpoint, and MAX_RESTARTS=1 restarts are used up" in log


def test_a_run_that_ends_on_a_disk_too_full_for_exit_status_json_is_not_restarted(tmp_path):
    """The disk holding the output folder fills during the run (the checkpoints live elsewhere). The
    run completed, but its exit_status.json did not fit: one line names the file and how the run
    ended, exit 74, and remote.sh does not take it for a crash: no restart."""
    out, log = tmp_path / "out", tmp_path / "remote.log"
    out.mkdir()
    fill = f'for i in $(seq 1200); do grep -q \'"step": 2\' "{out}/metrics.jsonl" 2>/dev/null && break; sleep 0.1; done; dd if=/dev/zero of="{out}/filler" bs=4k 2>/dev/null'
    args = " ".join(f"'{a}'" for a in [*small_args(4), f"--checkpoint.dir={tmp_path / 'ckpt'}", "--checkpoint.every=2"])
    script = f"({fill}) & bash launchers/remote.sh {args}; rc=$?; wait; exit $rc"
    done = in_a_small_disk("1m", out, script, remote_env(tmp_path, NPROC="1", MAX_RESTARTS="1", LOG=str(log)))
    if done is None:
        pytest.skip("this machine may not mount a tmpfs, even in a namespace of its own (unshare -m / -rm)")
    text = log.read_text()
    assert done.returncode == 74, text[-3000:]
    assert text.count("starting (attempt") == 1 and "not restarting" in text, text[-3000:]
    (line,) = [ln for ln in text.splitlines() if ln.startswith("plait: error:")]
    assert f"cannot write {out / 'exit_status.json'} at the end of the run (ENOSPC: " in line, line
    assert line.endswith("the run ended (completed) at step 4 with exit code 0"), line
    assert "OSError" not in text  # no traceback of the rank's (torchrun prints its own summary of any failed child)


def fake_python(tmp_path, attempts: str, **extra) -> dict[str, str]:
    """The environment of a launcher whose python runs the stand-in trainer: PY (k8s, slurm) and PYTHON (remote.sh)."""
    (tmp_path / "trainer.py").write_text(FAKE_TRAINER)
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (tmp_path / "out").mkdir(exist_ok=True)
    e = remote_env(
        tmp_path, PYTHON=str(python), PY=str(python), REAL_PY=sys.executable, FAKE_TRAINER=str(tmp_path / "trainer.py"), TMPDIR=str(tmp_path), **extra
    )
    e["FAKE_ATTEMPTS"] = attempts
    return e


def test_the_k8s_entrypoint_reads_the_trainers_last_words_and_ends_a_torchrun_that_outlives_its_ranks(tmp_path):
    """Without exit_status.json (rank 0 could not write it on a full disk) the entrypoint reads torchrun's output as
    remote.sh reads its log (trainer_end.sh, shared) and exits 74, which the Job's podFailurePolicy does not retry,
    rather than torchrun's 1, a restart onto the full disk. And a torchrun whose ranks have all ended but which never
    ends itself (waiting on the rendezvous store of a lost node) is ended after AGENT_GRACE_S, exit 1 (a restart)."""
    script = str(REPO / "launchers" / "k8s" / "entrypoint.sh")
    e = fake_python(tmp_path, "disk_full,outlived,diverged", NNODES="2", NPROC_PER_NODE="1", AGENT_GRACE_S="2")
    full = subprocess.run(["bash", script, "run.toml"], cwd=REPO, env=e, capture_output=True, text=True, timeout=60)
    assert full.returncode == 74, (full.returncode, full.stdout[-2000:], full.stderr[-2000:])
    assert "plait: error: checkpoint save at step 5 failed on rank 0" in full.stdout  # the pod's log still shows it
    assert "plait: entrypoint: a checkpoint could not be written (disk full?); not restarting" in full.stderr
    t0 = time.time()
    outlived = subprocess.run(["bash", script, "run.toml"], cwd=REPO, env=e, capture_output=True, text=True, timeout=60)
    assert outlived.returncode == 1 and time.time() - t0 < 30, (outlived.returncode, outlived.stderr[-2000:])
    assert "torchrun outlived this node's ranks by 2 s" in outlived.stderr
    diverged = subprocess.run(["bash", script, "run.toml"], cwd=REPO, env=e, capture_output=True, text=True, timeout=60)
    assert diverged.returncode == 3, diverged.stderr[-2000:]


def test_the_k8s_entrypoint_ends_a_torchrun_left_in_its_exit_barrier_once_the_run_recorded_its_end(tmp_path):
    """SIGTERM to one node of a multi-node job (a pre-empted VM) stops every rank with a checkpoint; rank 0 records it.
    The other nodes' torchrun agents then wait up to 300 s in their exit barrier for the signalled node's agent, which
    has exited 1: their pods held their GPUs idle for AGENT_GRACE_S (330 s). Now, once this attempt's exit_status.json
    records the end and the node's ranks are gone, the entrypoint ends torchrun after ENDED_GRACE_S, with the
    trainer's own code (143 for a stop by a signal: not done)."""
    script = str(REPO / "launchers" / "k8s" / "entrypoint.sh")
    e = fake_python(tmp_path, "ended_in_barrier", NNODES="2", NPROC_PER_NODE="1", AGENT_GRACE_S="60", ENDED_GRACE_S="1")
    t0 = time.time()
    proc = subprocess.run(["bash", script, "run.toml"], cwd=REPO, env=e, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143 and time.time() - t0 < 40, (proc.returncode, time.time() - t0, proc.stderr[-2000:])
    assert "torchrun outlived this node's ranks by 1 s (the run's end is recorded in" in proc.stderr, proc.stderr[-2000:]


def test_slurm_restarts_a_crash_or_a_stall_in_its_allocation_and_nothing_final(tmp_path):
    """SLURM requeues only its own pre-emptions and node failures; slurm.sbatch restarts a stall, a crash or a lost
    node from the last complete checkpoint as remote.sh does, in its allocation, and stops on what remote.sh stops on: an exit_status.json of any other reason
    (3: diverged) or the trainer's line of a failed save. srun and scontrol are stand-ins (srun runs its command here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nshift\nexec "$@"\n')  # drops --kill-on-bad-exit=1
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)

    def sbatch(attempts: str, **extra: str) -> tuple[subprocess.CompletedProcess, int]:
        for leftover in ("attempts", "exit_status.json"):
            (tmp_path / "out" / leftover).unlink(missing_ok=True)
        e = fake_python(tmp_path, attempts, SLURM_JOB_NODELIST="node1", SLURM_NNODES="2", SLURM_GPUS_PER_NODE="1", SLURM_JOB_ID="7", BACKOFF_S="0", **extra)
        e["PATH"] = os.pathsep.join([str(bin_dir), e["PATH"]])
        proc = subprocess.run(["bash", "launchers/slurm.sbatch", "run.toml"], cwd=REPO, env=e, capture_output=True, text=True, timeout=60)
        return proc, int((tmp_path / "out" / "attempts").read_text())

    proc, attempts = sbatch("stalled,stuck,progress,diverged")
    assert (proc.returncode, attempts) == (3, 4), (proc.returncode, attempts, proc.stderr[-2000:])
    assert "the trainer died (code 1, stalled); restarting" in proc.stderr and "the trainer died (code 1, no exit_status.json)" in proc.stderr
    proc, attempts = sbatch("progress,disk_full")
    assert (proc.returncode, attempts) == (74, 2) and "a checkpoint could not be written (disk full?)" in proc.stderr, proc.stderr[-2000:]
    proc, attempts = sbatch("stuck,stuck,stuck", MAX_RESTARTS="1")
    assert (proc.returncode, attempts) == (1, 2) and "MAX_RESTARTS=1 restarts are used up" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.bench  # two real attempts of remote.sh, about 90 s on 2 cores: the CI's 20 minutes
def test_a_restart_before_the_runs_first_save_starts_as_the_first_attempt_did(tmp_path):
    """RESUME names another folder's checkpoint, and the first attempt crashes before its first save. The
    restart starts as the first attempt did (with "auto" it would find nothing of the run's own and train
    from random weights, silently) until an attempt has committed a checkpoint. And an attempt that
    committed one is progress even when its step is older than the newest before it (a resume from an
    older checkpoint sets the later ones aside): MAX_RESTARTS does not count it."""
    seams = os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])
    source = tmp_path / "source"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "core.train",
            "--config",
            "train_configs/debug_cpu.toml",
            *small_args(6),
            f"--train.output_dir={source}",
            "--checkpoint.every=2",
        ],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    start = source / "checkpoints" / "step_000000004"
    args = ["bash", "launchers/remote.sh", *small_args(12)]
    e = remote_env(tmp_path, NPROC="1", BACKOFF_S="0", MAX_RESTARTS="1", RESUME=str(start), PYTHONPATH=seams, PLAIT_TEST_CRASH_AT_STEP="6")
    proc = subprocess.run(args, cwd=REPO, env=e, capture_output=True, text=True, timeout=600)
    log = (tmp_path / "out" / "remote.log").read_text()
    assert proc.returncode == 1 and log.count("starting (attempt") == 2, log[-3000:]
    assert f"starting (attempt 2, 1 processes, checkpoint.resume={start})" in log, log[-3000:]
    assert log.count(f"resumed from {start} at step 4") == 2 and "step 1/12" not in log, log[-3000:]
    # going back: the run's own step 2 of 2, 4, 6; the attempt commits a step 4 of its own, then crashes
    own = source / "checkpoints"
    e = remote_env(tmp_path, NPROC="1", BACKOFF_S="0", MAX_RESTARTS="0", OUTPUT_DIR=str(source), CKPT_EVERY="2", PYTHONPATH=seams, PLAIT_TEST_CRASH_AT_STEP="6")
    e["RESUME"] = str(own / "step_000000002")
    proc = subprocess.run(args, cwd=REPO, env=e, capture_output=True, text=True, timeout=600)
    log = (source / "remote.log").read_text()
    assert "trainer died (code 1; it committed step 4); restarting" in log, log[-3000:]
    assert "starting (attempt 2, 1 processes, checkpoint.resume=auto)" in log and f"resumed from {own / 'step_000000004'} at step 4" in log, log[-3000:]
    assert proc.returncode == 1 and "1 attempts in a row committed no new checkpoint, and MAX_RESTARTS=0" in log, log[-3000:]


def test_remote_sh_goes_past_an_unreadable_newest_checkpoint_in_one_attempt(tmp_path):
    """The newest step folder cannot be read (mode 000: NFS root squash, another owner; tests/seams, as
    the tests run as root): the attempt resumes the one before, sets the folder aside at the save of its
    step (one line) and ends with exit 0. It used to end each attempt in a PermissionError traceback at
    that save, which remote.sh restarted into until MAX_RESTARTS ran out."""
    seams = os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])
    args = ["bash", "launchers/remote.sh", *small_args(6)]
    proc = subprocess.run(args, cwd=REPO, env=remote_env(tmp_path, NPROC="1", CKPT_EVERY="3"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    root = tmp_path / "out" / "checkpoints"
    newest = root / "step_000000006"
    e = remote_env(tmp_path, NPROC="1", CKPT_EVERY="3", BACKOFF_S="0", MAX_RESTARTS="2", PYTHONPATH=seams, PLAIT_TEST_UNREADABLE=str(newest))
    proc = subprocess.run(args, cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    log = (tmp_path / "out" / "remote.log").read_text()
    assert proc.returncode == 0 and "Traceback" not in log, log[-3000:]
    assert log.count("starting (attempt") == 2 and f"resumed from {root / 'step_000000003'} at step 3" in log, log[-3000:]  # the first launch's, and this one's
    assert log.count("plait cannot read or replace it as a checkpoint") == 1, log[-3000:]
    assert json.loads((newest / "state.json").read_text())["step"] == 6 and (newest / "COMMITTED").is_file()


def test_remote_sh_with_a_log_it_cannot_write_says_so(tmp_path):
    log = tmp_path / "no_such_folder" / "remote.log"
    env = remote_env(tmp_path, LOG=str(log))
    proc = subprocess.run(["bash", "launchers/remote.sh", *small_args(2)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [
        f"plait: error: remote.sh: cannot write the log file LOG={log} (its folder is missing or read-only, or the file is not writable); set LOG to a writable file"
    ], proc.stderr[-2000:]
    assert "configuration is invalid" not in proc.stderr


def test_remote_sh_with_a_log_that_opens_but_takes_no_bytes_ends_with_74_naming_the_log(tmp_path):
    """LOG=/dev/full (a full log disk: the file opens, every write fails with ENOSPC) was taken for a bad
    configuration (exit 2, "not starting"). It is the log's failure, in one line, with a full disk's code
    74 (never retried), before any plan or attempt."""
    env = remote_env(tmp_path, LOG="/dev/full")
    proc = subprocess.run(["bash", "launchers/remote.sh", *small_args(2)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 74, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("plait: error: remote.sh: cannot write to the log file LOG=/dev/full (No space left on device"), lines
    assert "configuration is invalid" not in proc.stderr + proc.stdout and "starting (attempt" not in proc.stderr
