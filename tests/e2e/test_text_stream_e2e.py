"""The streaming source over real runs: it trains and resumes exactly; a bad line found mid-run stops with
a checkpoint and exit 2, on both ranks together; a killed rank leaves no worker or fork server behind;
workers under a long TMPDIR start and a run leaves nothing there."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, env, read_metrics, run_module
from shared import text_stream_config, varied_documents


@pytest.fixture
def corpus(tmp_path):
    return varied_documents(tmp_path)


@pytest.mark.slow
def test_trains_and_resumes_exactly(corpus, tmp_path):
    train = {"steps": 6, "global_batch_tokens": 256, "log_every": 1}
    cfg = text_stream_config(tmp_path / "stream.toml", corpus, train=train, data={"seq_len": 64, "workers": 2, "shuffle_buffer": 4}, monitors=["jsonl"])
    straight = tmp_path / "straight"
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={straight}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]  # the workers' queues are released at the end (fork server)
    out = tmp_path / "resumed"
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={out}", "--checkpoint.every=3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    import shutil

    shutil.rmtree(out / "checkpoints" / "step_000000006")
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={out}")
    assert proc.returncode == 0 and "at step 3" in proc.stdout, proc.stderr[-2000:]
    a = {r["step"]: r["loss"] for r in read_metrics(straight)}
    b = {r["step"]: r["loss"] for r in read_metrics(out)}
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]


@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.bench), 2])  # 0 workers: also the two-rank test below
def test_a_bad_line_found_mid_run_stops_with_a_checkpoint_and_exit_2(tiny_config, tmp_path, workers):
    """Only the first documents of each file are checked at start; a bad line later must not lose
    the run's work: every rank stops at a step boundary with a checkpoint, exit 2, naming file:line
    in one line (from a loader worker too, where torch wraps it in "Caught DataError in DataLoader
    worker process 0" and the worker's traceback, which the run printed and recorded as it was)."""
    good = "".join(json.dumps({"text": f"document {i}: " + "lorem ipsum " * 9}) + "\n" for i in range(400))
    path = tmp_path / "docs.jsonl"
    path.write_text(good + "{not json\n" + good)
    base = tiny_config(steps=200)
    cfg = tmp_path / "stream.toml"
    cfg.write_text(f'extends = "{base}"\n[data]\nname = "text_stream"\nfiles = ["{path}"]\n')  # switches plugin: path goes
    r = run_module("core.train", "--config", str(cfg), "--checkpoint.every=0", f"--data.workers={workers}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"{path}:401" in r.stderr and "Caught DataError" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    status = json.loads((tmp_path / "out" / "exit_status.json").read_text())
    assert status["exit_code"] == 2 and status["step"] > 0
    assert "\n" not in status["detail"] and status["detail"].startswith(f"bad data: {path}:401"), status["detail"]
    assert (tmp_path / "out" / "checkpoints" / f"step_{status['step']:09d}" / "COMMITTED").is_file()


def test_a_bad_line_on_one_rank_stops_both_ranks_together(tiny_config, tmp_path):
    """Each rank meets a bad line when its own reading reaches it. Rank 1's documents here are short,
    so it reads past line 201 steps before rank 0 does: it stopped to save while rank 0 went on into
    the step's all-reduce, and both hung until the stall watchdog (by default 1800 s x 3 at the first
    step) ended the run as "stalled", which launchers restart onto the same line. A stream's loader
    now makes the ranks agree on each step's data before any compute, whether it stops or wraps, and
    every rank's saved position is from before the step that did not run."""
    from conftest import torchrun

    docs = [json.dumps({"text": f"document {i}: " + ("lorem ipsum " * 60 if i % 2 == 0 else "short")}) for i in range(400)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(docs[:200] + ["{not json"] + docs[200:]) + "\n")
    base = tiny_config(steps=200)
    cfg = tmp_path / "stream.toml"
    cfg.write_text(f'extends = "{base}"\n[data]\nname = "text_stream"\nfiles = ["{path}"]\n')
    r = torchrun(2, "--config", str(cfg), "--checkpoint.every=0", "--train.stall_timeout_s=10", timeout=300)
    status = json.loads((tmp_path / "out" / "exit_status.json").read_text())
    assert r.returncode != 0 and status["exit_code"] == 2, (status, r.stderr[-3000:])
    assert f"rank 1: bad data: {path}:201" in r.stderr and "rank 0: bad data" not in r.stderr
    ckpt = tmp_path / "out" / "checkpoints" / f"step_{status['step']:09d}"
    assert (ckpt / "COMMITTED").is_file()
    # Each rank's saved position is the one after the checkpoint's step: rank 0 had already read its
    # batches of the step that never ran, and skipped them on resume.
    import tomllib

    train = tomllib.loads((tmp_path / "out" / "config.resolved.toml").read_text())["train"]
    seq_len = tomllib.loads((tmp_path / "out" / "config.resolved.toml").read_text())["data"]["seq_len"]
    accum = train["global_batch_tokens"] // (train["micro_batch"] * seq_len * 2)
    for rank in (0, 1):
        position = json.loads((ckpt / "rng" / f"data_rank_{rank}.json").read_text())["stream"]
        assert position["_num_yielded"] == status["step"] * accum, (rank, position["_num_yielded"], status["step"], accum)


def test_a_killed_rank_leaves_no_worker_or_fork_server_behind(corpus, tmp_path):
    """A rank killed without ending its workers (SIGKILL, the OOM killer): its fork server and workers
    end within seconds. Each worker held a copy of the server's keep-alive pipe, so the server
    waited for the workers and the workers (watching their parent, the server) for it, for good."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "rank.py"
    script.write_text(
        f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
if __name__ == "__main__":
    from core.contract.protocols import LoaderSpec
    from core.data.worker_start import server_pid
    from plugins.data.text_stream import TextStream, TextStreamOptions
    s = TextStream(TextStreamOptions(files=[{str(corpus)!r}], workers=2))
    s.validate(512, 32)
    it = iter(s.loader(LoaderSpec(32, 2, 1, 0, 1, 42)))
    next(it)
    server = server_pid()
    kids = open(f"/proc/{{server}}/task/{{server}}/children").read().split()
    print(server, *kids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""
    )
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as o, err.open("w") as e:  # files, not pipes: processes left behind would hold a pipe open
        r = subprocess.run([sys.executable, str(script)], stdout=o, stderr=e, timeout=120)
    pids = [int(p) for p in out.read_text().split()]
    assert r.returncode == -9 and len(pids) == 3, err.read_text()[-2000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2] for p in pids):
        time.sleep(0.5)
    left = [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
    for p in left:  # do not leave them behind on a failure either
        os.kill(p, 9)
    assert not left, f"still running 30 s after their rank was killed: {left} (fork server first)"


def test_workers_under_a_long_tmpdir_start_and_a_run_leaves_nothing_in_tmpdir(corpus, tmp_path):
    """The fork server's socket lives in ``<TMPDIR>/pymp-XXXXXXXX/``: under a TMPDIR too long for a
    socket's path (a scheduler's job folder deep in a scratch file system; ``OSError: AF_UNIX path
    too long``) the run starts, its socket in a short temporary folder. The rank ends with os._exit,
    which skips multiprocessing's removal of the ``pymp-`` folder: a clean end removes it. With no temporary folder at all the
    fork server's failure is one line, exit 2."""
    import subprocess
    import sys

    train = {"steps": 2, "global_batch_tokens": 128}
    cfg = text_stream_config(tmp_path / "stream.toml", corpus, train=train, data={"seq_len": 32, "workers": 1}, monitors=[])
    short, long = tmp_path / "tmp", tmp_path / ("t" * 100)
    for tmpdir in (short, long):
        tmpdir.mkdir()
        r = run_module("core.train", "--config", str(cfg), f"--train.output_dir={tmp_path / ('out_' + tmpdir.name[:8])}", extra_env={"TMPDIR": str(tmpdir)})
        assert r.returncode == 0, r.stderr[-2000:]
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
        assert not list(tmpdir.glob("pymp-*")), list(tmpdir.iterdir())
    no_short_folder = (  # no short folder to be found: the socket would go in the long TMPDIR itself
        "import sys\nfrom core.data import worker_start\nworker_start._socket_folder = lambda: None\n"
        "try:\n    worker_start.worker_context()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    r = subprocess.run([sys.executable, "-c", no_short_folder], cwd=REPO, env=env(TMPDIR=str(long)), capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("DataError data loader workers cannot start: their fork server's socket in a temporary folder (TMPDIR="), r.stdout + r.stderr
    assert "AF_UNIX path too long" in r.stdout and "set TMPDIR to a short folder this user can write, or data.workers = 0" in r.stdout
