"""Stops that must not lose work: loader workers and SIGTERM, a terminal's Ctrl-C under torchrun,
a full disk during a save. Real processes, real torchrun (gloo), real files."""

from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PY, REPO, env, read_metrics, start_module, torchrun_argv, write_tiny_config
from shared import committed_steps, remote_env, small_args, text_stream_config, varied_documents

pytestmark = pytest.mark.slow


def wait_for_steps(out: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (out / "metrics.jsonl").exists() and len(read_metrics(out)) >= n:
            return
        assert proc.poll() is None, f"the run ended early with {proc.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} steps in {timeout} s")


def children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def loader_workers(pid: int) -> list[int]:
    """The loader worker processes of rank ``pid``: the children of its fork server (core.data.worker_start)."""
    servers = [c for c in children(pid) if b"multiprocessing.forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return [w for server in servers for w in children(server)]


def rank_pids(torchrun_pid: int) -> dict[int, int]:
    """{RANK: pid} of the ranks a torchrun job started (its children)."""
    environs = {pid: Path(f"/proc/{pid}/environ").read_text().split("\0") for pid in children(torchrun_pid)}
    return {int(dict(line.split("=", 1) for line in lines if "=" in line)["RANK"]): pid for pid, lines in environs.items()}


def stopped_by_a_signal_at_step_2(proc: subprocess.Popen, out: Path, output: str) -> None:
    """The run in ``out`` ended cleanly as a signal stop at step 2, step 2's checkpoint its only one."""
    assert proc.returncode == 0, output[-3000:]
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "signal" and status["step"] == 2, status
    assert committed_steps(out) == ["step_000000002"]


def alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


# --- loader workers -------------------------------------------------------------------


def test_a_closed_terminal_stops_the_run_with_a_checkpoint(tmp_path):
    """SIGHUP: the terminal of a foreground ``python -m core.train`` or ``torchrun ...`` closed (a dropped
    ssh session), which the shell sends to the job's process group and torchrun forwards to its ranks
    ("Sending process N closing signal SIGHUP"). It stops the run as SIGTERM does (a checkpoint,
    exit_status.json, no step lost), never killing every rank at once; the
    loader's worker processes (text_stream, ``workers = 1``), which get it too, ignore it."""
    corpus = varied_documents(tmp_path, 400)
    cfg = write_tiny_config(tmp_path, steps=100000, global_batch_tokens=256)
    cmd = [PY, "-m", "core.train", "--config", str(cfg), "--data.name=text_stream", f'--data.files=["{corpus}"]', "--data.workers=1", "--data.seq_len=64"]
    proc = start_module(*cmd[2:])
    out = tmp_path / "out"
    try:
        wait_for_steps(out, 3, proc)
        assert len(loader_workers(proc.pid)) == 1  # the loader's worker
        os.killpg(proc.pid, signal.SIGHUP)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, (proc.returncode, stderr[-2000:])
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "signal" and status["exit_code"] == 0
    assert committed_steps(out) == [f"step_{status['step']:09d}"] and status["step"] == max(r["step"] for r in read_metrics(out))


def test_text_stream_workers_ignore_sigterm_and_die_with_their_rank(tmp_path):
    """``workers = 2``: a SIGTERM to the whole process group (as a scheduler or a terminal
        sends it) reaches the workers too; they ignore it and the rank stops at a step boundary
    with a checkpoint (never 'DataLoader worker ... exited unexpectedly' without a
    checkpoint). Then the resumed run's rank is SIGKILLed alone: the run folder is free at once
    (the workers hold no copy of its lock), and its fork server ends, then the workers (their parent
    gone), then the server's resource tracker."""
    corpus = varied_documents(tmp_path, 400)
    out = tmp_path / "out"
    train = {"steps": 100000, "global_batch_tokens": 256, "log_every": 1, "output_dir": out}
    cfg = text_stream_config(tmp_path / "stream.toml", corpus, train=train, data={"seq_len": 64, "workers": 2, "shuffle_buffer": 4}, monitors=["jsonl"])
    cmd = [PY, "-m", "core.train", "--config", str(cfg)]
    proc = start_module(*cmd[2:])
    try:
        wait_for_steps(out, 3, proc)
        assert len(loader_workers(proc.pid)) == 2  # the loader's two workers
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-2000:]
    assert "exited unexpectedly" not in stderr
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "signal" and status["exit_code"] == 0
    assert committed_steps(out) == [f"step_{status['step']:09d}"] and status["step"] == max(r["step"] for r in read_metrics(out))

    log = (tmp_path / "resumed.log").open("w")
    proc = start_module(*cmd[2:], stdout=log, stderr=subprocess.STDOUT)
    workers: list[int] = []
    try:
        wait_for_steps(out, status["step"] + 2, proc)
        assert len(loader_workers(proc.pid)) == 2
        workers = loader_workers(proc.pid) + children(proc.pid)  # and the fork server, and its resource tracker
        os.kill(proc.pid, signal.SIGKILL)  # the rank alone, not its group
        proc.wait(timeout=30)
        with (out / "plait.lock").open("a+") as lock:  # the workers hold no copy of the run-folder lock
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        deadline = time.time() + 20  # torch's worker loop checks its parent every 5 s
        while time.time() < deadline and any(alive(w) for w in workers):
            time.sleep(0.2)
        assert not any(alive(w) for w in workers), "loader workers or their fork server outlived their rank"
    finally:
        for w in workers + [proc.pid]:
            try:
                os.kill(w, signal.SIGKILL)
            except OSError:
                pass
        log.close()
    assert f"resumed from {out / 'checkpoints' / committed_steps(out)[0]} at step {status['step']}" in (tmp_path / "resumed.log").read_text()


# --- Ctrl-C under torchrun ------------------------------------------------------------


def torchrun_cmd(cfg: Path, *args: str) -> list[str]:
    return torchrun_argv(2, "--config", str(cfg), *args)


@pytest.fixture(scope="module")
def ctrl_c_run(tmp_path_factory):
    """A 2-rank torchrun run stopped by Ctrl-C as a terminal sends it: SIGINT to the whole
    foreground process group. torch 2.13's torchrun starts each rank in a session of its own,
    so that reaches torchrun, which forwards it to the ranks; launchers that leave the ranks in
    the terminal's group (older torchrun, srun) deliver it to the ranks directly as well, so the
    test also sends it to the ranks itself: each rank receives two. Checkpoints every 2 steps."""
    tmp = tmp_path_factory.mktemp("ctrl_c")
    cfg = write_tiny_config(tmp, steps=100000)
    out = tmp / "out"
    proc = subprocess.Popen(
        torchrun_cmd(cfg, "--checkpoint.every=2"), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        wait_for_steps(out, 5, proc)
        ranks = children(proc.pid)
        assert len(ranks) == 2
        os.killpg(proc.pid, signal.SIGINT)
        # Two SIGINTs that reach a rank while it is inside one C++ call merge into one Python
        # handler call; torchrun's forwarding can come later than that (a busy agent), so it is
        # sent once more here, 0.5 s later: well inside the window, after the first was handled.
        time.sleep(0.5)
        for rank in ranks:
            try:
                os.kill(rank, signal.SIGINT)
            except ProcessLookupError:  # that rank already stopped cleanly on the first
                pass
        output, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return cfg, out, output


def test_ctrl_c_to_the_process_group_under_torchrun_stops_cleanly(ctrl_c_run):
    _, out, output = ctrl_c_run
    assert "KeyboardInterrupt" not in output and "Traceback" not in output.split("Sending process")[0], output[-3000:]
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "signal" and status["exit_code"] == 0, status
    step = status["step"]
    assert step == max(r["step"] for r in read_metrics(out))  # the stop came at a step boundary ...
    assert f"step_{step:09d}" in committed_steps(out)  # ... with a checkpoint of it


def test_a_deliberate_second_ctrl_c_still_stops_at_once(tmp_path):
    """A second Ctrl-C after the 3 s window is a user who will not wait: the rank, held inside
    a save (a 60 s pause before the commit of step 2), stops at once instead of finishing it."""
    cfg = write_tiny_config(tmp_path, steps=100000)
    out = tmp_path / "out"
    seams = os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])
    proc = start_module("core.train", "--config", str(cfg), "--checkpoint.every=2", extra_env={"PLAIT_TEST_PAUSE_BEFORE_COMMIT": "2:60", "PYTHONPATH": seams})
    try:
        deadline = time.time() + 600  # the seam pauses after the shards and .metadata, before the commit
        while time.time() < deadline and not (out / "checkpoints" / "step_000000002" / ".metadata").exists():
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # within the window: the same stop
        time.sleep(3.5)
        assert proc.poll() is None  # still paused in the save
        t0 = time.time()
        os.killpg(proc.pid, signal.SIGINT)  # a deliberate second Ctrl-C
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.time() - t0 < 20 and proc.returncode != 0
    assert "KeyboardInterrupt" in stderr
    assert committed_steps(out) == []


# --- a full disk during a save --------------------------------------------------------

FSIZE_LIMIT = 200_000  # bytes: above the run's logs and json files, below its DCP shards (~1.5 MB)


def limited_file_size() -> None:
    # RLIMIT_FSIZE makes any write past FSIZE_LIMIT bytes in one file fail, for root too, as
    # a full disk makes it fail (EFBIG instead of ENOSPC). Python ignores SIGXFSZ, so the write
    # raises instead of killing the process; torchrun and both ranks inherit the limit.
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_during_a_save_stops_every_rank_with_code_74(ctrl_c_run, tmp_path, mode):
    """The Ctrl-C'd run resumes onto a "full disk": the next save (step N+2) cannot write its
    shards. Every rank stops together; the partial folder is removed, and nothing else;
    ``exit_status.json`` says ``save_failed`` with exit code 74; one error line, no rank
    tracebacks; the earlier checkpoints still verify and load."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from core.checkpoint.folders import verify

    cfg, first, _ = ctrl_c_run
    out = tmp_path / "out"
    shutil.copytree(first, out)
    before = committed_steps(out)
    stopped = json.loads((out / "exit_status.json").read_text())["step"]
    proc = subprocess.run(
        torchrun_cmd(cfg, f"--train.output_dir={out}", "--checkpoint.every=2", f"--train.steps={stopped + 6}", f"--checkpoint.async={mode == 'async'}".lower()),
        check=False,
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=180,
        preexec_fn=limited_file_size,
    )
    assert proc.returncode != 0  # torchrun reports any failing rank as 1; launchers read exit_status.json
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "save_failed" and status["exit_code"] == 74, status
    failed = stopped + 2 if stopped % 2 == 0 else stopped + 1
    assert f"checkpoint save at step {failed} failed" in status["detail"]
    assert f"the last complete checkpoint is {before[-1]}" in status["detail"]
    assert not (out / "checkpoints" / f"step_{failed:09d}").exists()  # this save's partial folder is gone ...
    assert committed_steps(out) == before  # ... and nothing else
    errors = [line for line in proc.stderr.splitlines() if line.startswith("plait: error:")]
    assert len(errors) == 1 and "disk full?" in errors[0], proc.stderr[-3000:]
    assert "[rank0]" not in proc.stderr and "[rank1]" not in proc.stderr, proc.stderr[-3000:]
    for name in before:
        path = out / "checkpoints" / name
        verify(path)
        sd: dict = {}
        _load_state_dict(sd, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        assert any(k.startswith("model") for k in sd)


def test_a_full_disk_for_the_run_files_at_start_stops_every_rank_with_code_74(tiny_config, tmp_path):
    """config.resolved.toml does not fit (a file-size limit of 1000 bytes, EFBIG, as a full disk
    gives ENOSPC): not a traceback with exit_status.json saying "error", which launchers would
    restart, but every rank stopping before the first step: one line naming
    the file and the OS error, exit_status.json with 74, no rank traceback, no summary."""
    out = tmp_path / "out"

    def tiny_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))

    proc = subprocess.run(
        torchrun_argv(2, "--config", str(tiny_config())), cwd=REPO, env=env(), capture_output=True, text=True, timeout=120, preexec_fn=tiny_files
    )
    assert proc.returncode != 0
    status = json.loads((out / "exit_status.json").read_text())
    assert status["exit_code"] == 74 and status["reason"] == "write_failed" and status["step"] == 0, status
    errors = [line for line in proc.stderr.splitlines() if line.startswith("plait: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"cannot write {out / 'config.resolved.toml'} at start (EFBIG: File too large" in errors[0]
    assert "exitcode  : 74" in proc.stderr and "exitcode  : 1 " not in proc.stderr  # both ranks: 74
    assert "[rank0]" not in proc.stderr and "[rank1]" not in proc.stderr and "plait: model" not in proc.stdout, proc.stderr[-3000:]
    assert not (out / "config.resolved.toml").exists() and not list(out.glob("*.tmp"))  # no partial file left


def test_remote_sh_does_not_restart_onto_a_full_disk(tmp_path):
    """launchers/remote.sh reads exit code 74 from exit_status.json and stops: no restart loop."""
    out = tmp_path / "out"
    e = remote_env(tmp_path, MAX_RESTARTS="2", CKPT_EVERY="2")
    proc = subprocess.run(
        ["bash", "launchers/remote.sh", *small_args(6)], check=False, cwd=REPO, env=e, capture_output=True, text=True, timeout=300, preexec_fn=limited_file_size
    )
    assert proc.returncode == 74, proc.stderr[-3000:]
    assert json.loads((out / "exit_status.json").read_text())["reason"] == "save_failed"
    log = (out / "remote.log").read_text()
    assert log.count("starting (attempt") == 1 and "trainer finished with exit code 74" in log
    assert committed_steps(out) == [] and not (out / "checkpoints" / "step_000000002").exists()


def test_a_run_whose_console_is_gone_still_stops_cleanly(tmp_path):
    """The reader of the ranks' output goes away (a launcher's ``tee`` killed by the Ctrl-C that
    reaches its whole process group, a closed terminal): every later line a rank prints fails
    with EPIPE. The run trains on, and a SIGTERM still stops it at a step boundary with a
    checkpoint of that step, instead of a BrokenPipeError that turned the console monitor's next
    line into a monitor failure and then into a failed checkpoint save."""
    cfg = write_tiny_config(tmp_path, steps=100000)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        torchrun_cmd(cfg, "--checkpoint.every=1000"), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_for_steps(out, 3, proc)
        assert proc.stdout is not None
        proc.stdout.close()  # nobody reads the ranks' output any more
        printed = len(read_metrics(out))
        wait_for_steps(out, printed + 3, proc)  # steps whose lines went nowhere
        os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards it to the ranks
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "signal" and status["exit_code"] == 0, status
    assert status["step"] == max(r["step"] for r in read_metrics(out)) and f"step_{status['step']:09d}" in committed_steps(out)


# --- a signal during validation ---------------------------------------------------------------


def test_a_signal_during_a_long_validation_stops_every_rank_at_once_with_a_checkpoint(tmp_path):
    """A pre-emption's grace (30 s) went to a validation pass, which looked at no signal until it
    ended (here: never, a million batches). SIGTERM to rank 0 alone: under fsdp2, whose forward
    gathers shards, rank 1 must leave the pass at the same batch, or both hang. The pass is not
    recorded; the step before it is saved, and the run ends as a signal stop."""
    cfg = write_tiny_config(tmp_path, steps=100000)
    out = tmp_path / "out"
    args = ["--config", str(cfg), "--parallelism.name=fsdp2", "--validation.every=2", "--validation.batches=1000000"]
    proc = subprocess.Popen(torchrun_argv(2, *args), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(out, 2, proc)
        time.sleep(1.0)  # inside the pass by now
        ranks = rank_pids(proc.pid)
        os.kill(ranks[0], signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped_by_a_signal_at_step_2(proc, out, output)
    assert read_metrics(out, "val") == [] and "validation interrupted by a signal" in output


def write_long_task(path: Path, examples: int) -> Path:
    """A task file whose pass takes minutes at batch_size 1 on the tiny model (four multi-token continuations each)."""
    lines = (
        json.dumps(
            {"context": f"example {i} " + "to be or not to be " * 2, "continuations": [" that is", " the question", " whether", " tis nobler"], "gold": i % 4}
        )
        for i in range(examples)
    )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("nproc", [1, 2], ids=["one process", "two ranks under fsdp2"])
def test_a_signal_during_a_downstream_evaluation_pass_stops_at_once_with_a_checkpoint(tmp_path, nproc):
    """The downstream monitor's pass (a large task file, limit = 0) looked at no signal until it ended,
    minutes later: a pre-emption's grace went to it and SIGKILL lost the steps since the last save.
    It asks before every forward (every rank together: under fsdp2 a forward gathers shards); SIGTERM
    to rank 0 alone ends the pass, unrecorded, and the run stops at that step with its checkpoint."""
    task = write_long_task(tmp_path / "long.jsonl", 20_000)
    body = f'[monitors.downstream]\nevery = 2\ntasks = ["{task}"]\nlimit = 0\nbatch_size = 1\n'
    cfg = write_tiny_config(tmp_path, steps=100000, body=body)
    cfg.write_text(cfg.read_text().replace('enabled = ["console", "jsonl"]', 'enabled = ["downstream", "console", "jsonl"]'))
    out = tmp_path / "out"
    args = ["--config", str(cfg), "--checkpoint.every=1000"]
    if nproc == 1:
        proc = start_module("core.train", *args, stderr=subprocess.STDOUT)
    else:
        cmd = torchrun_argv(2, *args, "--parallelism.name=fsdp2")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(out, 1, proc)
        time.sleep(2.0)  # step 2 is done and its evaluation pass under way (minutes of forwards)
        if nproc == 1:
            rank0 = proc.pid
        else:
            rank0 = rank_pids(proc.pid)[0]
        os.kill(rank0, signal.SIGTERM)
        t0 = time.time()
        output, _ = proc.communicate(timeout=60)  # without the check: the pass runs on for minutes
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped_by_a_signal_at_step_2(proc, out, output)
    assert "step 2: downstream evaluation interrupted by a signal; not recorded" in output, output[-3000:]
    assert not any(k.startswith("eval/") for r in read_metrics(out) for k in r)
    print(f"stopped {took:.1f} s after SIGTERM")


# --- a hung rank ----------------------------------------------------------------------------


@pytest.mark.parametrize("every", [1_000_000, 1], ids=["between saves", "saving every step"])
def test_a_hung_rank_fails_the_run_after_collective_timeout_s(tmp_path, every):
    """A rank that stops answering (SIGSTOP here; a dead NIC or a D-state read alike) held the
    others in their next collective for the fixed 30 minutes. train.collective_timeout_s bounds
    it, the control plane's own group included: the run fails, and a launcher restarts it."""
    cfg = write_tiny_config(tmp_path, steps=100000)
    out = tmp_path / "out"
    # Saving every step, the freeze lands in a save's collectives (DCP's own gloo group, which had
    # torch's 30 minutes: rank 0 waited past the 90 s this test allows).
    args = ["--config", str(cfg), "--train.collective_timeout_s=5", f"--checkpoint.every={every}"]
    proc = subprocess.Popen(torchrun_argv(2, *args), cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped = None
    try:
        wait_for_steps(out, 3, proc)
        ranks = rank_pids(proc.pid)
        stopped = ranks[1]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.time()
        while alive(ranks[0]) and time.time() - t0 < 90:  # rank 0 waits in its next collective
            time.sleep(0.2)
        waited = time.time() - t0
    finally:
        if stopped is not None:  # the frozen rank is the test's own doing: it goes, and torchrun ends the job
            os.kill(stopped, signal.SIGKILL)
            os.kill(stopped, signal.SIGCONT)
        try:
            output, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert waited < 45, (waited, output[-3000:])
    assert proc.returncode != 0 and "Timed out waiting 5000ms" in output, output[-3000:]
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "error" and status["exit_code"] == 1, status
    # one line says what the timeout means (not the gloo traceback alone), and exit_status.json records it
    said = "rank 0: another rank did not answer within train.collective_timeout_s = 5 s (Timed out waiting 5000ms"
    assert f"plait: error: {said}" in output and status["detail"].startswith(f"PeerLost: {said}"), (status, output[-3000:])
