"""Faults from outside a running job: unreadable and undeletable checkpoints, checkpoint
folders that every save would collide with, data changed under a run, data that is silently wrong,
crafted checkpoint state, and the launchers' and loggers' own failures. Real runs, real files, real
DCP checkpoints; two gloo ranks where ranks must agree.

The tests run as root, which file modes do not stop: a folder or file without read permission (NFS
with root squash) is ``PLAIT_TEST_UNREADABLE`` (tests/seams), and one that cannot be deleted is a
real immutable file (``chattr +i``).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import PY, REPO, env, run_module, start_module, torchrun, torchrun_argv, write_tiny_config
from shared import committed

from core.checkpoint.folders import verifies

pytestmark = pytest.mark.slow

SEAMS = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])}


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("plait: error: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


# --- item 3: checkpoints that cannot be read, or deleted ------------------------------------------


def test_an_unreadable_checkpoint_is_skipped_with_a_line_or_refused_when_named(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=6, body="[checkpoint]\nevery = 3\nkeep_latest = 0\n")
    root = tmp_path / "out" / "checkpoints"
    r = torchrun(2, "--config", str(cfg))
    assert r.returncode == 0, r.stderr[-2000:]
    newest = root / "step_000000006"
    for denied in (newest, newest / "COMMITTED", newest / "state.json"):  # a folder, the marker, the state: mode 000
        for launch in (torchrun, None) if denied == newest else (None,):  # two ranks, then one process
            env = {**SEAMS, "PLAIT_TEST_UNREADABLE": str(denied)}
            args = ("--config", str(cfg), "--train.steps=5", "--checkpoint.at_end=false")
            r = torchrun(2, *args, extra_env=env) if launch else run_module("core.train", *args, extra_env=env)
            assert r.returncode == 0, (denied, r.stderr[-2000:])
            skipped = [line for line in r.stderr.splitlines() if "skipping checkpoint" in line]
            assert len(skipped) == 1 and all(w in skipped[0] for w in ("step_000000006", "unreadable", "Permission denied")), r.stderr[-2000:]
            assert f"checkpoint {root / 'step_000000003'}: the config differs" in r.stderr and "Traceback" not in r.stderr  # resumed from it
        # named explicitly, it is one line and exit code 2
        line = one_error_line(run_module("core.train", "--config", str(cfg), f"--checkpoint.resume={newest}", extra_env=env))
        assert "step_000000006" in line and "unreadable" in line and "Permission denied" in line
    assert committed(root) == ["step_000000003", "step_000000006"]


def test_a_save_onto_a_step_folder_it_cannot_read_sets_that_aside_in_one_line_and_the_run_goes_on(tmp_path):
    """The newest step folder is unreadable (mode 000: NFS root squash, another owner), or a file or a
    link to nothing stands at its name: resume = "auto" resumes the one before, and the save of that
    step sets what is there aside in one line and saves in its place, under one process and two ranks.
    Without write permission a folder cannot leave its folder (rename(2)): it is renamed beside it,
    under a name of its own even when an earlier one was set aside in the same second."""
    cfg = write_tiny_config(tmp_path, steps=6, body="[checkpoint]\nevery = 3\nkeep_latest = 0\n")
    root = tmp_path / "out" / "checkpoints"
    assert run_module("core.train", "--config", str(cfg)).returncode == 0
    newest = root / "step_000000006"
    for what, launch in (("unreadable", run_module), ("unreadable", torchrun), ("file", run_module), ("link", run_module)):
        extra: dict[str, str] = {}
        if what == "unreadable":
            extra = {**SEAMS, "PLAIT_TEST_UNREADABLE": str(newest)}
        else:
            shutil.rmtree(newest)
            newest.write_text("a user's notes\n") if what == "file" else newest.symlink_to(tmp_path / "gone")
        before = {p.name for p in root.iterdir()} | {"abandoned"}
        r = run_module("core.train", "--config", str(cfg), extra_env=extra) if launch is run_module else torchrun(2, "--config", str(cfg), extra_env=extra)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (what, r.stderr[-2000:])
        lines = [line for line in r.stderr.splitlines() if "plait cannot read or replace it as a checkpoint" in line]
        why = {"unreadable": "cannot be read (Permission denied)", "file": "is not a folder", "link": "is a link to nothing"}[what]
        assert len(lines) == 1 and f"{newest} {why}" in lines[0] and "this save takes its name" in lines[0], (what, r.stderr[-2000:])
        assert committed(root)[-1] == "step_000000006" and verifies(newest), (what, r.stderr[-2000:])  # no step beyond checkpoint.every lost
        if what == "unreadable":  # renamed beside it, whole: the checkpoint it was
            beside = [root / n for n in {p.name for p in root.iterdir()} - before]
            assert len(beside) == 1 and beside[0].name.endswith("_before_step_000000006") and str(beside[0]) in lines[0], (before, lines[0])
            assert verifies(beside[0])
        else:  # moved to abandoned/, unchanged
            moved = [p / "step_000000006" for p in (root / "abandoned").glob("*_before_step_000000006") if str(p / "step_000000006") in lines[0]]
            assert len(moved) == 1 and os.path.lexists(moved[0]), lines[0]
            assert moved[0].read_text() == "a user's notes\n" if what == "file" else not moved[0].exists()


def test_a_save_onto_a_mode_000_step_folder_renames_it_beside_under_an_unprivileged_user():
    """The same as a user whom file modes stop, for real: the newest step folder is mode 000, its owner
    cannot move it out of its folder (rename(2) rewrites its ``..``), so the save renames it beside and
    saves in its place. Root (the CI) runs the trainer as ``nobody`` through ``setpriv``."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root, which mode 000 does not stop, and setpriv (util-linux) is not installed to run the trainer as nobody")
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    base = Path(tempfile.mkdtemp(prefix="plait-unprivileged-"))  # pytest's tmp_path is root's alone
    try:
        base.chmod(0o777)
        cfg = write_tiny_config(base, steps=6, body="[checkpoint]\nevery = 3\nkeep_latest = 0\n")
        cfg.chmod(0o644)
        root = base / "out" / "checkpoints"

        def train(*prefix: str) -> subprocess.CompletedProcess:
            e = env(HOME=str(base), TMPDIR=str(base))
            return subprocess.run([*prefix, PY, "-m", "core.train", "--config", str(cfg)], cwd=REPO, env=e, capture_output=True, text=True, timeout=300)

        r = train()  # by this interpreter: nobody may reach another one (a venv's base in root's home)
        assert r.returncode == 0, r.stderr[-2000:]
        if prefix:
            for p in [base, *base.rglob("*")]:
                os.chown(p, 65534, 65534, follow_symlinks=False)
        newest = root / "step_000000006"
        newest.chmod(0o000)
        r = train(*prefix)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
        skipped = [line for line in r.stderr.splitlines() if "skipping checkpoint" in line]
        assert len(skipped) == 1 and "step_000000006" in skipped[0] and "Permission denied" in skipped[0], r.stderr[-2000:]
        lines = [line for line in r.stderr.splitlines() if "plait cannot read or replace it as a checkpoint" in line]
        assert len(lines) == 1 and f"{newest} cannot be read (Permission denied)" in lines[0], r.stderr[-2000:]
        beside = list(root.glob("abandoned_*_before_step_000000006"))
        assert len(beside) == 1 and str(beside[0]) in lines[0] and stat.S_IMODE(beside[0].stat().st_mode) == 0, lines[0]
        assert committed(root)[-1] == "step_000000006" and json.loads((newest / "state.json").read_text())["step"] == 6, r.stderr[-2000:]
    finally:
        for p in base.rglob("*"):
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o755)
        shutil.rmtree(base)


def test_a_checkpoint_without_its_commit_marker_is_skipped_with_a_line(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=6, body="[checkpoint]\nevery = 3\nkeep_latest = 0\n")
    root = tmp_path / "out" / "checkpoints"
    assert run_module("core.train", "--config", str(cfg)).returncode == 0
    (root / "step_000000006" / "COMMITTED").unlink()
    r = run_module("core.train", "--config", str(cfg), "--train.steps=5", "--checkpoint.at_end=false")
    assert r.returncode == 0, r.stderr[-2000:]
    skipped = [line for line in r.stderr.splitlines() if "skipping checkpoint" in line]
    assert len(skipped) == 1 and "step_000000006: no COMMITTED marker" in skipped[0], r.stderr[-2000:]
    assert f"checkpoint {root / 'step_000000003'}: the config differs" in r.stderr  # resumed from it


def test_a_prune_that_cannot_delete_an_old_checkpoint_warns_and_training_goes_on(tmp_path):
    if shutil.which("chattr") is None:
        pytest.fail("chattr is needed to make a file that cannot be deleted")
    cfg = write_tiny_config(tmp_path, steps=3, body="[checkpoint]\nevery = 1\nkeep_latest = 1\nkeep_lowest_loss = false\n")
    root = tmp_path / "out" / "checkpoints"
    assert run_module("core.train", "--config", str(cfg)).returncode == 0
    shard = next((root / "step_000000003").glob("*.distcp"))
    subprocess.run(["chattr", "+i", str(shard)], check=True)
    try:
        r = torchrun(2, "--config", str(cfg), "--train.steps=6")
    finally:
        subprocess.run(["chattr", "-i", str(shard)], check=True)
    assert r.returncode == 0, r.stderr[-2000:]
    warned = [line for line in r.stderr.splitlines() if "could not delete old checkpoint" in line]
    assert len(warned) == 1 and "step_000000003" in warned[0], r.stderr[-2000:]
    assert committed(root) == ["step_000000006"]  # what it could not delete lies there uncommitted, never resumed


# --- item 2: a data file changed under a running job ----------------------------------------------


@pytest.mark.parametrize("change", ["truncated", "rewritten"])
def test_a_data_file_changed_under_a_running_job_is_one_line_with_its_exit_status(tmp_path, change):
    data = tmp_path / "data"
    shutil.copytree(REPO / "plugins" / "data" / "corpus" / "shakespeare", data)
    cfg = write_tiny_config(tmp_path, steps=4, global_batch_tokens=512, body="[checkpoint]\nevery = 2\n")
    out, go = tmp_path / "out", tmp_path / "go"
    args = ("--config", str(cfg), f"--data.path={data}")
    seams = {**SEAMS, "PLAIT_TEST_WAIT_BEFORE_STEP": f"3:{go}"}
    if change == "truncated":
        job = subprocess.Popen(torchrun_argv(2, *args), cwd=REPO, env=env(**seams), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    else:
        job = start_module("core.train", *args, extra_env=seams)
    try:
        while not Path(f"{go}.waiting").exists():  # steps 1 and 2 trained, step 2 saved
            assert job.poll() is None, job.communicate()[1][-3000:]
            time.sleep(0.1)
        train_bin = data / "train.bin"
        if change == "truncated":
            os.truncate(train_bin, 4096)
        else:  # the same size, other tokens, written into the same file (its inode kept)
            tokens = train_bin.read_bytes()
            with open(train_bin, "r+b") as f:
                f.write(tokens[::-1])
        go.touch()
        _, stderr = job.communicate(timeout=600)
    finally:
        job.kill()
    assert "SIGBUS" not in stderr and "exitcode: -7" not in stderr, stderr[-3000:]
    if change == "truncated":  # torchrun: its own summary of ranks that exited 2 (the code launchers never restart)
        assert job.returncode == 1 and "(exitcode: 2)" in stderr and "core/train.py" not in stderr, stderr[-3000:]
    else:
        assert job.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    errors = {line for line in stderr.splitlines() if line.startswith("plait: error:")}
    assert errors and all(f"{train_bin} changed under the run: {change}" in line for line in errors), stderr[-3000:]
    status = json.loads((out / "exit_status.json").read_text())
    assert status["exit_code"] == 2 and status["reason"] == "bad_input", status  # docs/operations.md pairs them: never a monitor's request
    assert f"{train_bin} changed under the run: {change}" in status["detail"], status
    assert committed(out / "checkpoints") == ["step_000000002"]
    assert verifies(out / "checkpoints" / "step_000000002")


# --- item 6: a crafted state.json naming a larger model -------------------------------------------


def test_a_state_json_naming_a_larger_model_is_refused_before_it_is_built(tmp_path):

    from core.checkpoint.folders import manifest_files

    cfg = write_tiny_config(tmp_path, steps=1)
    assert run_module("core.train", "--config", str(cfg)).returncode == 0
    ckpt = tmp_path / "out" / "checkpoints" / "step_000000001"
    state = json.loads((ckpt / "state.json").read_text())
    state["config"]["model"] = {"name": "llama3", "flavor": "8b"}  # 8 billion parameters: 32 GB in fp32
    (ckpt / "state.json").write_text(json.dumps(state))
    manifest = json.loads((ckpt / "COMMITTED").read_text())
    manifest.update(manifest_files(ckpt, exclude="COMMITTED", known={}))  # checksums regenerated, as an attacker would
    (ckpt / "COMMITTED").write_text(json.dumps(manifest))

    for argv in (  # a 16 GiB address space: without the check, the build fails there rather than exhausting the machine
        ["core.export", "--checkpoint", str(ckpt), "--format", "safetensors", "--out", str(tmp_path / "exported")],
        ["core.generate", "--checkpoint", str(ckpt), "--device", "cpu"],
    ):
        r = run_module(*argv, address_space=16 << 30)
        line = one_error_line(r)
        assert f"checkpoint {ckpt} does not fit the model" in line, line


# --- item 4: every checkpoint damaged --------------------------------------------------------------


def test_a_fresh_start_after_every_checkpoint_was_damaged_saves_in_their_place(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=6, global_batch_tokens=512, body="[checkpoint]\nevery = 3\nkeep_latest = 0\n")
    root = tmp_path / "out" / "checkpoints"
    assert run_module("core.train", "--config", str(cfg)).returncode == 0
    for step in ("step_000000003", "step_000000006"):  # bit rot in a shard of each: found once the ranks check them
        shard = next((root / step).glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    r = torchrun(2, "--config", str(cfg), "--train.steps=7")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "belongs to another run" not in r.stderr and "no usable checkpoint" in r.stderr, r.stderr[-3000:]
    moved = [line for line in r.stderr.splitlines() if "could not be resumed" in line]
    assert len(moved) == 1 and "step_000000003 to step_000000006" in moved[0], r.stderr[-3000:]
    assert committed(root) == ["step_000000003", "step_000000006", "step_000000007"]  # every save of the fresh start
    assert all(verifies(root / s) for s in committed(root))
    (aside,) = (root / "abandoned").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["step_000000003", "step_000000006"]  # kept, never deleted
