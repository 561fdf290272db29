"""Who owns what in a run folder: a restart continues its own run, a dead save never blocks its
step, a checkpoint folder inside another job's output folder is locked too, a resume from a copy
leaves this run's later checkpoints aside (never deleted), a checkpoint larger than the model is
refused, and folders a user named like checkpoints are not plait's. Real runs, real DCP
checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, env, run_here, run_module, start_module, write_tiny_config
from shared import THEIRS, committed

pytestmark = pytest.mark.slow


def markers(root: Path) -> dict[str, str]:
    return {name: (root / name / "COMMITTED").read_text() for name in committed(root)}


def train(cfg: Path, *args: str) -> subprocess.CompletedProcess:
    return run_module("core.train", "--config", str(cfg), *args)


def test_a_restart_continues_its_own_run_not_another_runs_newer_checkpoints_beside_it(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=8, body="[checkpoint]\nevery = 4\nkeep_latest = 0\n")
    root = tmp_path / "out" / "checkpoints"
    assert train(cfg).returncode == 0  # run A: step 4 and step 8
    theirs = markers(root)
    # run B trains beside them, then is "killed" after step 3 (a restart of the same command with resume = auto)
    r = train(cfg, "--checkpoint.resume=none", "--checkpoint.allow_foreign=true", "--checkpoint.every=3", "--train.steps=3")
    assert r.returncode == 0, r.stderr[-2000:]
    r = train(cfg, "--checkpoint.every=3", "--train.steps=6")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step_000000003 at step 3" in r.stdout, r.stdout[-2000:]  # B's own, not A's newer step 8
    assert {k: v for k, v in markers(root).items() if k in theirs} == theirs  # A's checkpoints untouched
    assert committed(root) == ["step_000000003", "step_000000004", "step_000000006", "step_000000008"]


def test_a_save_killed_before_its_commit_does_not_block_its_step(tmp_path):
    """A run killed inside its first save leaves an uncommitted folder; the restart starts fresh (a new
    run), and its save of that step moves the dead folder aside instead of being skipped for good."""
    cfg = write_tiny_config(tmp_path, steps=4, body="[checkpoint]\nevery = 0\n")
    dead = tmp_path / "out" / "checkpoints" / "step_000000004"
    dead.mkdir(parents=True)
    (dead / "LINEAGE").write_text("0" * 32 + "\n")
    (dead / "__0_0.distcp").write_bytes(b"half a shard")
    r = train(cfg)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "save is skipped" not in r.stderr and (dead / "COMMITTED").is_file()
    (moved,) = (dead.parent / "abandoned").glob("*/step_000000004")
    assert (moved / "__0_0.distcp").read_bytes() == b"half a shard"  # kept, never deleted


def test_a_checkpoint_folder_inside_a_running_jobs_output_folder_is_locked_and_its_status_untouched(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=2)
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from core.runtime import ownership; ownership.lock_run_folders([{str(out)!r}, {str(out / 'checkpoints')!r}]); print('held', flush=True); input()",
        ],
        cwd=REPO,
        env=env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        r = train(cfg, f"--train.output_dir={tmp_path / 'other'}", f"--checkpoint.dir={out / 'checkpoints'}")
        assert r.returncode == 2 and "is in use by pid" in r.stderr and str(out / "checkpoints") in r.stderr, r.stderr[-2000:]
        r = train(cfg)  # the same output folder: refused, and the running job's exit_status.json is not written
        assert r.returncode == 2 and "is in use by pid" in r.stderr
        assert not (out / "exit_status.json").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_resume_from_a_copy_of_an_older_checkpoint_sets_the_later_ones_aside(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=8, body="[checkpoint]\nevery = 4\nkeep_latest = 0\n")
    root = tmp_path / "out" / "checkpoints"
    assert train(cfg).returncode == 0
    later = markers(root)["step_000000008"]
    copy = tmp_path / "backup" / "step_000000004"
    shutil.copytree(root / "step_000000004", copy)
    r = train(cfg, f"--checkpoint.resume={copy}", "--optimizer.lr=1e-3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step_000000004 at step 4" in r.stdout and "later one(s)" in r.stderr, r.stderr[-2000:]
    (moved,) = (root / "abandoned").glob("*/step_000000008")
    assert (moved / "COMMITTED").read_text() == later  # the left branch's step 8, unchanged
    assert (root / "step_000000008" / "COMMITTED").read_text() != later  # the new branch's own step 8


def test_a_checkpoint_with_layers_the_model_lacks_is_refused(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=2)
    assert train(cfg, "--model.n_layers=3").returncode == 0
    r = train(cfg, "--train.steps=4")  # the override forgotten: loading would drop layer 2 without a word
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert "holds model keys the model lacks" in r.stderr and "layers.2." in r.stderr


def test_folders_a_user_named_like_checkpoints_are_not_plaits(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=4, body="[checkpoint]\nevery = 2\nkeep_latest = 1\nkeep_lowest_loss = false\n")
    root = tmp_path / "out" / "checkpoints"
    assert train(cfg).returncode == 0
    keep = root / "step_000000004_keep"
    shutil.copytree(root / "step_000000004", keep)
    r = train(cfg, "--train.steps=8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step_000000004 at step 4" in r.stdout and "_keep" not in r.stdout
    assert keep.is_dir() and committed(root) == ["step_000000004_keep", "step_000000008"]
    assert json.loads((keep / "state.json").read_text())["step"] == 4


def test_initial_weights_are_checked_before_anything_is_built(tmp_path):
    """``checkpoint.initial_load`` of a damaged checkpoint, or of one of another shape, is one line and
    exit 2 from ``core.plan`` and before training, as a resume's checkpoint is (it was found only
    after the process group and the model existed, or not at all for a larger model)."""
    cfg = write_tiny_config(tmp_path, steps=2)
    assert train(cfg, "--model.n_layers=3", f"--train.output_dir={tmp_path / 'three'}").returncode == 0
    three = tmp_path / "three" / "checkpoints" / "step_000000002"
    for module in ("core.plan", "core.train"):
        r = run_here(module, "--config", str(cfg), f"--checkpoint.initial_load={three}")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "model keys the model lacks" in r.stderr, r.stderr[-2000:]
    shard = next(three.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    r = run_here("core.plan", "--config", str(cfg), "--model.n_layers=3", f"--checkpoint.initial_load={three}")
    assert r.returncode == 2 and shard.name in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]


def test_bad_input_of_a_second_job_leaves_the_running_jobs_exit_status_alone(tmp_path):
    """Under torchrun, bad input found before the folder lock is taken is recorded in exit_status.json
    (exit code 2) for launchers, only when no other process holds the folder: a running job killed
    later (the OOM killer) must not look like bad input to its launcher, which never retries that."""
    cfg = write_tiny_config(tmp_path, steps=2)
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from core.runtime import ownership; ownership.lock_run_folders([{str(out)!r}]); print('held', flush=True); input()"],
        cwd=REPO,
        env=env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    torchrun_env = {"TORCHELASTIC_RUN_ID": "second-job"}  # what torchrun sets in its ranks
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        r = run_module("core.train", "--config", str(cfg), "--checkpoint.every=-1", extra_env=torchrun_env)
        assert r.returncode == 2 and "[checkpoint].every: must be >= 0, got -1" in r.stderr, r.stderr[-2000:]
        assert not (out / "exit_status.json").exists()
    finally:
        holder.kill()
        holder.wait()
    r = run_module("core.train", "--config", str(cfg), "--checkpoint.every=-1", extra_env=torchrun_env)  # nobody holds it now
    assert r.returncode == 2 and json.loads((out / "exit_status.json").read_text())["reason"] == "bad_input"


def test_a_job_started_as_another_ends_resumes_what_that_job_saved_last(tmp_path):
    """Job B lists the checkpoints to resume from only once it holds the folder's lock. Started while
    job A is in its last save, a list made earlier would name step 4, which A prunes after committing
    step 6: B would find it gone and start a new run from step 0."""
    import os
    import time

    cfg = write_tiny_config(tmp_path, steps=6, body="[checkpoint]\nevery = 2\nkeep_latest = 1\n")
    root = tmp_path / "out" / "checkpoints"
    assert train(cfg, "--train.steps=4").returncode == 0
    seams = os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])
    go_a, go_b = tmp_path / "go_a", tmp_path / "go_b"

    def start(*args: str, **extra: str):
        return start_module("core.train", "--config", str(cfg), *args, extra_env={"PYTHONPATH": seams, **extra}, stderr=subprocess.STDOUT)

    def wait_for(path: Path) -> None:
        deadline = time.monotonic() + 600
        while not path.exists():
            assert time.monotonic() < deadline, f"{path} never appeared"
            time.sleep(0.1)

    a = start(PLAIT_TEST_WAIT_BEFORE_COMMIT=f"6:{go_a}")
    b = None
    try:
        wait_for(root / "step_000000006" / ".metadata")  # A is in its last save, before the commit
        b = start("--train.steps=8", PLAIT_TEST_WAIT_BEFORE_LOCK=str(go_b))
        wait_for(Path(f"{go_b}.ready"))  # B's preflight is done up to the lock
        go_a.touch()
        a_out = a.communicate(timeout=120)[0]
        assert a.returncode == 0 and not (root / "step_000000004").exists(), a_out[-2000:]
        go_b.touch()
        b_out = b.communicate(timeout=120)[0]
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert b.returncode == 0 and f"resumed from {root / 'step_000000006'} at step 6" in b_out, b_out[-2000:]
    assert committed(root) == ["step_000000008"] and "another run" not in b_out


# A holder on another host whose file system does not share flock: it holds no lock this host can see,
# and renews its record in plait.lock every 0.2 s, as core.runtime.ownership's holders do every LEASE_S.
OTHER_HOST_HOLDER = """
import json, os, sys, time
path, n = sys.argv[1], 0
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
while True:
    record = {"pid": 4242, "host": "node-b", "since": "2026-11-26T00:00:00Z", "command": "core.train", "lease_s": 0.2, "renewals": n}
    # as plait renews its record: over the last one in one write, never truncated (the test kills this
    # process at any point, and must find the last record whole)
    text = json.dumps(record)
    os.pwrite(fd, (text.ljust(os.fstat(fd).st_size - 1) + "\\n").encode(), 0)
    print("renewed", flush=True)
    n += 1
    time.sleep(0.2)
"""


def test_a_job_on_another_host_whose_lock_this_host_cannot_see_keeps_the_folder(tmp_path):
    """On NFS mounted with nolock, or a FUSE mount of an object store, flock is not shared between hosts:
    so the holder renews its record in plait.lock, and a job that finds another host's record never released
    watches it for two lease periods first: renewed, it is refused as for a held lock (exit 2)."""
    cfg = write_tiny_config(tmp_path, steps=2)
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", OTHER_HOST_HOLDER, str(out / "plait.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "renewed"
        r = train(cfg)
        assert r.returncode == 2, r.stderr[-2000:]
        assert "did not release it; waiting 1 s to see that it is gone" in r.stdout, r.stdout[-2000:]
        (line,) = [x for x in r.stderr.splitlines() if x.startswith("plait: error:")]
        assert f"run folder {out} is in use by pid 4242 on node-b" in line, line
        assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    finally:
        holder.kill()
        holder.wait()
    # the same record left behind (that host crashed, its job never released it): watched, then taken
    r = train(cfg)
    assert r.returncode == 0 and "waiting 1 s to see that it is gone" in r.stdout, r.stderr[-2000:]
    record = json.loads((out / "plait.lock").read_text())
    assert record["released"] is True and record["pid"] != 4242, record  # a clean end says so: no watch next time
    r = train(cfg, "--train.steps=3")
    assert r.returncode == 0 and "waiting" not in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("who_first", ["this_run", "another_job"])
def test_a_run_folder_moved_aside_mid_run_keeps_one_writer(tmp_path, who_first):
    """``mv out out.old`` (or ``rm -rf out``) while a run trains: its next save made ``out`` again,
    unlocked, and a job started there meanwhile or later wrote into it too: it resumed what the old
    run saved there, the two pruned, moved aside and collided with each other's saves (one of them
    ended with exit 74). Now each save first checks that the run still holds its folders: the run
    locks the folder made anew (one warning) and a later job is refused, or, when a job took the new
    folder first, the run stops with exit code 2 naming it (two ranks: both stop) and that job stays
    its one writer."""
    import os
    import time

    from conftest import torchrun_argv

    cfg = write_tiny_config(tmp_path, steps=6, body="[checkpoint]\nevery = 2\n")
    out, old = tmp_path / "out", tmp_path / "out.old"
    seams = os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])
    go, go_again, go_b = tmp_path / "go", tmp_path / "go_again", tmp_path / "go_b"

    def wait_for(path: Path) -> None:
        deadline = time.monotonic() + 600
        while not path.exists():
            assert time.monotonic() < deadline, f"{path} never appeared"
            time.sleep(0.1)

    def start(argv: list[str], **extra: str):
        if argv[1:3] == ["-m", "core.train"]:
            return start_module(*argv[2:], extra_env={"PYTHONPATH": seams, **extra}, stderr=subprocess.STDOUT)
        return subprocess.Popen(argv, cwd=REPO, env=env(PYTHONPATH=seams, **extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    waits = f"3:{go},5:{go_again}"
    a = start(torchrun_argv(2, "--config", str(cfg)), PLAIT_TEST_WAIT_BEFORE_STEP=waits)
    b = None
    try:
        wait_for(Path(f"{go}.waiting"))  # the run is between its saves of steps 2 and 4
        os.replace(out, old)
        b_argv = [sys.executable, "-m", "core.train", "--config", str(cfg), "--train.steps=2"]
        if who_first == "this_run":
            go.touch()
            wait_for(out / "checkpoints" / "step_000000004" / "COMMITTED")  # the run's next save, into `out` made anew
            b = start(b_argv)
            b_out = b.communicate(timeout=180)[0]
            assert b.returncode == 2 and f"run folder {out} is in use by pid" in b_out, b_out[-2000:]
            go_again.touch()
            a_out = a.communicate(timeout=180)[0]
            assert a.returncode == 0, a_out[-3000:]
            assert f"plait: warning: run folder {out} was deleted or replaced while this run held it; this run holds it again" in a_out
            assert committed(out / "checkpoints") == ["step_000000004", "step_000000006"]
        else:
            b = start(b_argv, PLAIT_TEST_WAIT_BEFORE_STEP=f"1:{go_b}")
            wait_for(out / "plait.lock")  # the other job holds `out`
            wait_for(out / "config.resolved.toml")
            go.touch()
            a_out = a.communicate(timeout=180)[0]
            assert a.returncode != 0, a_out[-3000:]  # torchrun reports a child's exit code 2 as 1
            errors = [line for line in a_out.splitlines() if line.startswith("plait: error:")]
            assert len(errors) == 1 and errors[0].startswith(f"plait: error: run folder {out} is in use by pid {b.pid}"), a_out[-3000:]
            assert a_out.count("exitcode  : 2 (pid") == 2, a_out[-3000:]  # both ranks, in torchrun's summary
            assert not (out / "exit_status.json").exists()  # that job's folder: its launcher reads its own end there
            go_b.touch()
            b_out = b.communicate(timeout=180)[0]
            assert b.returncode == 0, b_out[-2000:]
            assert committed(out / "checkpoints") == ["step_000000002"]  # its own save, and none of the other run's
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert committed(old / "checkpoints") == ["step_000000002"]  # what was moved aside is left as it is


def test_a_failed_save_never_deletes_a_folder_it_did_not_make(tmp_path):
    """A folder of the user's named like the step about to be saved (no LINEAGE: not plait's) is moved
    to ``abandoned/`` by the save's claim; when that move fails (here ``abandoned`` is a file of theirs
    too), the save ends with exit 74 and removes only a folder it made itself: the user's folder, its
    notes and their file stay as they were."""
    cfg = write_tiny_config(tmp_path, steps=4)
    root = tmp_path / "out" / "checkpoints"
    (root / "step_000000002").mkdir(parents=True)
    (root / "step_000000002" / "notes.txt").write_text("my notes\n")
    (root / "abandoned").write_text("not a folder\n")
    proc = train(cfg, "--checkpoint.every=2")
    assert proc.returncode == 74, proc.stderr[-2000:]
    assert "checkpoint save at step 2 failed on rank 0: NotADirectoryError" in proc.stderr
    assert (root / "step_000000002" / "notes.txt").read_text() == "my notes\n"
    assert (root / "abandoned").read_text() == "not a folder\n"


@pytest.mark.parametrize("woken_in", ["its_lease", "its_save", "its_commit"])
def test_a_holder_frozen_past_its_lease_stops_when_another_host_took_its_folder(tmp_path, woken_in):
    """A holder stopped longer than its lease (SIGSTOP, a paused VM, a stall on a network mount) on a file
    system whose flock is not shared between hosts, while a job on another host takes the folder. Woken
    up, it must not write over the new holder's record or train on there: it reads the record before each
    renewal (``its_lease``: two ranks, short leases), each save (``its_save``) and each commit
    (``its_commit``: the save's shards written while it slept), and ends at once with exit code 2 and one
    line naming that job, having written nothing more there: no record, no checkpoint, no exit_status.json.
    The line says the folder "is in use by" that job, so launchers/remote.sh ends instead of restarting."""
    import os
    import signal
    import time

    from conftest import torchrun_argv

    cfg = write_tiny_config(tmp_path, steps=6, body="[checkpoint]\nevery = 2\n")
    out = tmp_path / "out"
    root = out / "checkpoints"
    seams = os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])
    go = tmp_path / "go"

    def wait_for(path: Path) -> None:
        deadline = time.monotonic() + 600
        while not path.exists():
            assert time.monotonic() < deadline, f"{path} never appeared"
            time.sleep(0.1)

    if woken_in == "its_lease":
        argv, seam = torchrun_argv(2, "--config", str(cfg)), {"PLAIT_TEST_WAIT_BEFORE_STEP": f"3:{go}", "PLAIT_TEST_LEASE_S": "0.2"}
    else:  # a lease too long to renew during the test: only the save's or the commit's own look can find the takeover
        argv = [sys.executable, "-m", "core.train", "--config", str(cfg)]
        wait = "PLAIT_TEST_WAIT_BEFORE_STEP" if woken_in == "its_save" else "PLAIT_TEST_WAIT_BEFORE_COMMIT"
        seam = {wait: f"{3 if woken_in == 'its_save' else 4}:{go}", "PLAIT_TEST_LEASE_S": "1000"}
    if argv[1:3] == ["-m", "core.train"]:
        a = start_module(*argv[2:], extra_env={"PYTHONPATH": seams, **seam}, stderr=subprocess.STDOUT)
    else:
        a = subprocess.Popen(argv, cwd=REPO, env=env(PYTHONPATH=seams, **seam), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(Path(f"{go}.waiting") if woken_in != "its_commit" else root / "step_000000004" / ".metadata")
        holder = json.loads((out / "plait.lock").read_text())["pid"]  # rank 0
        os.kill(holder, signal.SIGSTOP)
        for folder in (out, root):  # the other host's job, after its watch, holds both folders
            (folder / "plait.lock").write_text(json.dumps(THEIRS) + "\n")
        if woken_in != "its_lease":  # its_lease: the run stays parked, and its renewing thread alone can find the takeover
            go.touch()
        os.kill(holder, signal.SIGCONT)
        a_out = a.communicate(timeout=180)[0]
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    assert a.returncode == (1 if woken_in == "its_lease" else 2), a_out[-3000:]  # torchrun reports a child's exit code 2 as 1
    errors = [line for line in a_out.splitlines() if line.startswith("plait: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"plait: error: run folder {out}"), a_out[-3000:]
    assert "is in use by pid 4242 on node-b" in errors[0] and "took it over" in errors[0] and "writes nothing more there" in errors[0]
    if woken_in == "its_lease":
        assert "exitcode  : 2 (pid" in a_out, a_out[-3000:]  # rank 0's own exit code, in torchrun's summary
    for folder in (out, root):
        assert json.loads((folder / "plait.lock").read_text()) == THEIRS  # never written over, nor marked released
    assert committed(root) == ["step_000000002"] and not (out / "exit_status.json").exists()


def test_a_record_whose_lease_is_not_a_number_is_watched_for_the_default_lease(tmp_path, monkeypatch):
    """A record with ``lease_s`` NaN (a damaged or foreign record: JSON as Python reads it) made the
    watch zero seconds long, so a start took a folder whose holder on another host was renewing it."""
    from core.runtime import ownership

    monkeypatch.setattr(ownership, "LEASE_S", 0.2)  # the default lease stands in for NaN: a 1.4 s watch
    path = tmp_path / "plait.lock"
    renewer = OTHER_HOST_HOLDER.replace('"lease_s": 0.2', '"lease_s": float("nan")')
    holder = subprocess.Popen([sys.executable, "-c", renewer, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "renewed"
        record = ownership._read_record(path)
        assert record["host"] == "node-b" and record["lease_s"] != record["lease_s"], record  # NaN
        assert ownership.alive_elsewhere(path, record)
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_on_another_machine_with_this_hosts_name_is_watched(tmp_path, monkeypatch):
    """Two machines whose containers have the same host name (a compose file's ``hostname:``): a start
    took the other machine's record for one of this host, whose flock it shares, and took the folder
    at once while that job renewed it. The record now names the kernel's boot id too."""
    import socket

    from core.runtime import ownership

    path = tmp_path / "plait.lock"
    renewer = OTHER_HOST_HOLDER.replace('"host": "node-b"', f'"host": {socket.gethostname()!r}, "boot": "another-machine"')
    holder = subprocess.Popen([sys.executable, "-c", renewer, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "renewed"
        assert ownership.alive_elsewhere(path, ownership._read_record(path))
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.setattr(ownership, "_record", {})
    ownership.lock_run_folders([tmp_path / "mine"])  # this host's own record says which kernel wrote it
    try:
        record = json.loads((tmp_path / "mine" / "plait.lock").read_text())
        assert record["boot"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        assert not ownership.alive_elsewhere(tmp_path / "mine" / "plait.lock", {**record, "pid": 1})  # same kernel: its flock says
    finally:
        ownership.release_run_folders(ended=True)


# What a tool may leave in plait.lock: an editor's save of half a record, bytes that are no text, a
# value nested without end, a JSON object that names no holder, a record of 10 MB.
DAMAGED_RECORDS = {
    "truncated": b'{"pid": 4242, "host": "node-b", "since": "2026-11-',
    "garbage_bytes": bytes(range(256)) * 4,
    "nested_without_end": b"[" * 100_000,
    "names_no_holder": b'{"note": "edited by hand"}\n',
    "ten_megabytes": json.dumps({"pad": "x" * 10_000_000}).encode(),
}

LOCAL_HOLDER = """
import json, sys
from core.runtime import ownership
ownership.LEASE_S = 0.05
ownership.lock_run_folders([sys.argv[1]])
print("held", flush=True)
sys.stdin.readline()  # the test damages the record meanwhile; the renewing thread looks at it
import time
deadline = time.monotonic() + 600  # five renewals over the damage: a wait on the file, long only on a loaded machine
while time.monotonic() < deadline:
    try:
        if json.load(open(sys.argv[1] + "/plait.lock"))["renewals"] >= 5:
            break
    except (ValueError, KeyError, TypeError, RecursionError):  # the damage, until the first renewal over it
        pass
    time.sleep(0.05)
ownership.fence()  # what each save and commit does
print("renewals", json.load(open(sys.argv[1] + "/plait.lock"))["renewals"], flush=True)
"""


@pytest.mark.parametrize("damage", list(DAMAGED_RECORDS))
def test_a_lock_record_a_tool_damaged_is_no_holder_never_a_traceback_or_a_fence(tmp_path, damage):
    """``plait.lock`` written by something other than plait: a value nested without end, or a JSON
    object naming no holder, is neither a traceback (at a start, in ``core.plan`` or in a running
    holder's renewing thread) nor another job's record. The reader reads the file as untrusted (``core.runtime.small_files``) and a record without pid and host is
    none: a start takes the folder, and a holder renews its record over the damage and trains on."""
    from core.runtime import ownership

    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "plait.lock").write_bytes(DAMAGED_RECORDS[damage])
    assert ownership._holder(folder / "plait.lock") == "another process (no holder recorded)"
    ownership.check_run_folders([folder])  # what core.plan asks
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCAL_HOLDER, str(folder)], cwd=REPO, env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held", holder.communicate(timeout=60)[1][-2000:]
        (folder / "plait.lock").write_bytes(DAMAGED_RECORDS[damage])  # in place, as an editor writing through the file does
        out, err = holder.communicate("go\n", timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert holder.returncode == 0 and "Traceback" not in err and "error" not in err, err[-2000:]
    assert int(out.split()[-1]) >= 5, out  # renewed over the damage all along
