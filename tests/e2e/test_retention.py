"""Retention under a diverging loss and after a resume from an older checkpoint.

Two ways the newest checkpoints stop being the good ones, neither of which loses data:
a loss that rises without reaching NaN (the lowest-loss checkpoint is kept), and a
resume from an older checkpoint (the abandoned branch's later checkpoints are set aside,
so pruning by step never deletes the new branch's saves and an automatic restart
continues the new branch). Real runs,
real DCP checkpoints; the branch resume runs on two gloo ranks.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run_module, torchrun, write_tiny_config

pytestmark = pytest.mark.slow


def steps_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("step_*") if (p / "COMMITTED").is_file())


def train_loss(ckpt: Path) -> float | None:
    return json.loads((ckpt / "state.json").read_text())["train_loss"]


def test_a_diverging_loss_never_prunes_the_lowest_loss_checkpoint(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=14, body="[optimizer]\nlr = 3e-3\n[checkpoint]\nevery = 2\nkeep_latest = 2\n")
    root = tmp_path / "out" / "checkpoints"
    r = run_module("core.train", "--config", str(cfg), "--train.steps=6")
    assert r.returncode == 0, r.stderr[-2000:]
    good = train_loss(root / "step_000000006")
    assert good is not None and good < train_loss(root / "step_000000004")  # the mean loss since the previous save
    # the same run goes on with an LR a thousand times too high: the loss rises far, but stays finite
    r = run_module("core.train", "--config", str(cfg), "--optimizer.lr=3.0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_in(root) == ["step_000000006", "step_000000012", "step_000000014"]
    assert train_loss(root / "step_000000014") > 2 * good
    kept = [line for line in r.stderr.splitlines() if "lowest training loss" in line]
    assert len(kept) == 1 and "step_000000006" in kept[0] and 'resume="' in kept[0], r.stderr[-2000:]


def test_keep_lowest_loss_off_prunes_by_step_alone(tmp_path):
    body = "[optimizer]\nlr = 3e-3\n[checkpoint]\nevery = 2\nkeep_latest = 2\nkeep_lowest_loss = false\nkeep_measured = false\n"  # on, the jump holds step 6
    cfg = write_tiny_config(tmp_path, steps=14, body=body)
    root = tmp_path / "out" / "checkpoints"
    assert run_module("core.train", "--config", str(cfg), "--train.steps=6").returncode == 0
    r = run_module("core.train", "--config", str(cfg), "--optimizer.lr=3.0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_in(root) == ["step_000000012", "step_000000014"]
    assert "lowest training loss" not in r.stderr


def test_keep_every_keeps_every_nth_step_for_good_and_a_resume_goes_on_from_the_newest(tmp_path):
    body = "[checkpoint]\nevery = 2\nkeep_latest = 1\nkeep_every = 4\nkeep_lowest_loss = false\n"
    cfg = write_tiny_config(tmp_path, steps=12, body=body)
    root = tmp_path / "out" / "checkpoints"
    r = run_module("core.train", "--config", str(cfg))
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_in(root) == ["step_000000004", "step_000000008", "step_000000012"]
    r = run_module("core.train", "--config", str(cfg), "--train.steps=18")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed from {root / 'step_000000012'} at step 12" in r.stdout + r.stderr, r.stdout[-2000:]
    assert steps_in(root) == ["step_000000004", "step_000000008", "step_000000012", "step_000000016", "step_000000018"]


def test_resume_from_an_older_checkpoint_sets_the_later_ones_aside(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=12, body="[checkpoint]\nevery = 3\nkeep_latest = 0\n")
    root = tmp_path / "out" / "checkpoints"
    r = torchrun(2, "--config", str(cfg))
    assert r.returncode == 0, r.stderr[-2000:]
    old = {s: (root / s / "COMMITTED").read_text() for s in ("step_000000009", "step_000000012")}
    # train_loss: the mean over both ranks of the steps since the previous save (7, 8, 9), as logged
    logged = {row["step"]: row["loss"] for row in read_metrics(tmp_path / "out")}
    assert train_loss(root / "step_000000009") == pytest.approx(sum(logged[s] for s in (7, 8, 9)) / 3, rel=1e-6)
    # a new branch from step 6 with another LR, on two ranks, pruning to the newest two
    r = torchrun(2, "--config", str(cfg), f"--checkpoint.resume={root / 'step_000000006'}", "--checkpoint.keep_latest=2", "--optimizer.lr=1e-4")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if "branch this run leaves" in line]
    assert len(lines) == 1 and "step_000000009 to step_000000012" in lines[0], r.stderr[-2000:]
    # the new branch's saves survive pruning; the abandoned ones are kept, unchanged, out of the way
    assert steps_in(root) == ["step_000000009", "step_000000012"]
    assert all((root / s / "COMMITTED").read_text() != old[s] for s in old)
    (aside,) = (root / "abandoned").iterdir()
    assert aside.name.endswith("_after_step_000000006")
    assert {s: (aside / s / "COMMITTED").read_text() for s in steps_in(aside)} == old
    # an automatic restart continues the new branch (its step 12 is the one resumed)
    new12 = (root / "step_000000012" / "COMMITTED").read_text()
    r = run_module("core.train", "--config", str(cfg), "--train.steps=13")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed from {root / 'step_000000012'} at step 12" in r.stdout + r.stderr
    assert "branch" not in r.stdout + r.stderr
    assert old["step_000000012"] != new12 and (aside / "step_000000012" / "COMMITTED").read_text() == old["step_000000012"]


def test_a_branch_that_cannot_be_set_aside_stops_before_training(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=6, body="[checkpoint]\nevery = 3\n")
    root = tmp_path / "out" / "checkpoints"
    assert run_module("core.train", "--config", str(cfg)).returncode == 0
    metrics = (tmp_path / "out" / "metrics.jsonl").read_text()
    (root / "abandoned").write_text("a file where the folder would go\n")
    r = run_module("core.train", "--config", str(cfg), f"--checkpoint.resume={root / 'step_000000003'}")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert "could not move this run's later checkpoints aside" in lines[-1] and str(root) in lines[-1], r.stderr[-2000:]
    assert steps_in(root) == ["step_000000003", "step_000000006"]
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == metrics  # not a step trained


def test_a_step_count_started_over_needs_a_checkpoint_folder_of_its_own(tmp_path):
    """Excluding 'train' starts the step count and the lineage over: beside the checkpoints it came
    from, the run's saves at steps 9 and 12 were skipped as another run's (its final state never
    saved) and the next automatic resume took the old run's step 12."""
    cfg = write_tiny_config(tmp_path, steps=12, body="[checkpoint]\nevery = 3\nkeep_latest = 0\n")
    root = tmp_path / "out" / "checkpoints"
    assert run_module("core.train", "--config", str(cfg)).returncode == 0
    before = {p.name: (p / "COMMITTED").read_text() for p in root.glob("step_*")}
    r = run_module("core.train", "--config", str(cfg), '--checkpoint.exclude_from_loading=["train"]')
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "would start over at step 0 from" in lines[0] and "collide" in lines[0], r.stderr
    assert {p.name: (p / "COMMITTED").read_text() for p in root.glob("step_*")} == before
    # in a folder of its own it starts over; the same command again would start over once more: refused
    again = [f"--train.output_dir={tmp_path / 'over'}", f"--checkpoint.resume={root / 'step_000000012'}", '--checkpoint.exclude_from_loading=["train"]']
    r = run_module("core.train", "--config", str(cfg), "--train.steps=6", *again)
    assert r.returncode == 0, r.stderr[-2000:]
    assert steps_in(tmp_path / "over" / "checkpoints") == ["step_000000003", "step_000000006"]
    r = run_module("core.train", "--config", str(cfg), "--train.steps=6", *again)
    assert r.returncode == 2 and "a restart of this command?" in r.stderr, r.stderr[-2000:]


def test_setting_a_branch_aside_keeps_best_json_true(tmp_path):
    from core.checkpoint.folders import lineage_of
    from core.checkpoint.retention import set_aside_later

    body = "[checkpoint]\nevery = 2\nkeep_latest = 0\nkeep_best = 2\n[validation]\nevery = 2\nbatches = 1\n"
    cfg = write_tiny_config(tmp_path, steps=6, body=body)
    assert run_module("core.train", "--config", str(cfg)).returncode == 0
    root = tmp_path / "out" / "checkpoints"
    listed = [b["step"] for b in json.loads((root / "BEST.json").read_text())["best"]]
    assert len(listed) == 2 and 6 in listed  # the loss falls: the newest validation is among the best two
    dest = set_aside_later(root, lineage_of(root / "step_000000002"), root / "step_000000002", 2, chosen=True)
    assert dest is not None and steps_in(dest) == ["step_000000004", "step_000000006"]
    best = json.loads((root / "BEST.json").read_text())["best"]
    assert [b["step"] for b in best] == [s for s in listed if s == 2] and all((root / b["path"]).is_dir() for b in best)


def test_a_start_killed_while_setting_a_branch_aside_never_resumes_the_branch(tmp_path):
    """The set-aside is one rename per folder; a kill between two of them leaves the rest in place,
    where resume = "auto" must not pick them. The marker written first names them: auto skips them and the
    next start moves them."""
    cfg = write_tiny_config(tmp_path, steps=12, body="[checkpoint]\nevery = 3\nkeep_latest = 0\n")
    root = tmp_path / "out" / "checkpoints"
    assert run_module("core.train", "--config", str(cfg)).returncode == 0
    # as a start that resumed from step 6 leaves it, killed after moving step 9 and before step 12
    (root / "SETTING_ASIDE.json").write_text(json.dumps(["step_000000009", "step_000000012"]))
    (root / "abandoned" / "x_after_step_000000006").mkdir(parents=True)
    (root / "step_000000009").rename(root / "abandoned" / "x_after_step_000000006" / "step_000000009")
    r = run_module("core.train", "--config", str(cfg), "--train.steps=7")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed from {root / 'step_000000006'} at step 6" in r.stdout + r.stderr
    assert "killed while moving step_000000009, step_000000012 aside" in r.stderr
    assert steps_in(root) == ["step_000000003", "step_000000006", "step_000000007"]
    moved = {p.name: p.parent.name for p in (root / "abandoned").glob("*/step_*")}
    assert moved["step_000000009"] == "x_after_step_000000006" and moved["step_000000012"].endswith("Z_after_step_000000006")
    assert not (root / "SETTING_ASIDE.json").exists()


def test_a_start_killed_after_its_last_set_aside_move_does_not_hide_later_saves_of_those_steps(tmp_path):
    """A kill after the last move but before SETTING_ASIDE.json was removed left the marker behind:
    the next start had nothing left to move, so nothing removed it, and it went on naming step 4. That
    start saved step 4 again (the branch it continues); the one after skipped that good checkpoint,
    resumed from step 2 and set step 4 aside: the steps since were lost to every later restart."""
    cfg = write_tiny_config(tmp_path, steps=4, body="[checkpoint]\nevery = 2\nkeep_latest = 0\n")
    root = tmp_path / "out" / "checkpoints"
    assert run_module("core.train", "--config", str(cfg)).returncode == 0
    # as a start that resumed from step 2 leaves it, killed after moving step 4 and before removing the marker
    (root / "abandoned" / "x_after_step_000000002").mkdir(parents=True)
    (root / "step_000000004").rename(root / "abandoned" / "x_after_step_000000002" / "step_000000004")
    (root / "SETTING_ASIDE.json").write_text(json.dumps(["step_000000004"]))
    r = run_module("core.train", "--config", str(cfg))
    assert r.returncode == 0 and f"resumed from {root / 'step_000000002'} at step 2" in r.stdout + r.stderr, r.stderr[-2000:]
    assert not (root / "SETTING_ASIDE.json").exists()
    r = run_module("core.train", "--config", str(cfg), "--train.steps=5")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed from {root / 'step_000000004'} at step 4" in r.stdout + r.stderr
    assert "aside" not in r.stderr and steps_in(root) == ["step_000000002", "step_000000004", "step_000000005"]


def test_a_kill_while_pruning_leaves_nothing_that_outlives_the_next_prune(tmp_path):
    """SIGKILL right after pruning removed the first file of step 2: the folder kept its COMMITTED
    marker with a shard gone, a damaged checkpoint of this run that no prune deletes ("not ours to
    judge") and that held its disk space for good. The marker now goes first and LINEAGE last, so what
    a kill leaves is this run's unfinished folder, which the next prune removes."""
    from conftest import REPO

    cfg = write_tiny_config(tmp_path, steps=4, body="[checkpoint]\nevery = 2\nkeep_latest = 1\n")
    root = tmp_path / "out" / "checkpoints"
    seams = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])}
    r = run_module("core.train", "--config", str(cfg), extra_env={**seams, "PLAIT_TEST_KILL_IN_DELETE_AFTER": str(root / "step_000000004" / "COMMITTED")})
    assert r.returncode == -9 and (root / "step_000000002").is_dir() and (root / "step_000000004" / "COMMITTED").is_file(), r.stderr[-2000:]
    r = run_module("core.train", "--config", str(cfg), "--train.steps=6")
    assert r.returncode == 0 and f"resumed from {root / 'step_000000004'}" in r.stdout + r.stderr, r.stderr[-2000:]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000000006"]  # committed or not


def weights_loss(ckpt: Path) -> dict | None:
    return json.loads((ckpt / "state.json").read_text())["weights_loss"]


def test_a_diverged_update_is_never_kept_as_the_best_and_the_next_start_goes_back_before_it(tmp_path, capsys):
    """Two good steps (every = 1, keep_latest = 1), then the same run resumed with an LR of 1e6: step 3
    still computes a finite loss on the good weights of step 2 and is saved, but its update collapses
    the model; a later step has a NaN gradient norm: exit 3, reason diverged. metrics.jsonl logs that
    NaN as strict JSON (null, named in not_finite). Each checkpoint's loss is the one measured on its
    own weights (the next save's ``weights_loss``): with keep_measured, step 2 is the lowest and survives keep_latest = 1.
    The next start (core.plan and core.train alike) goes back to it in one line and sets the later ones
    aside; an explicit --checkpoint.resume overrides the choice."""
    from core.cli import plan

    cfg = write_tiny_config(
        tmp_path, steps=12, body='[optimizer]\nlr = 0.3\n[lr_schedule]\nname = "constant"\n[checkpoint]\nevery = 1\nkeep_latest = 1\nkeep_measured = true\n'
    )
    out, root = tmp_path / "out", tmp_path / "out" / "checkpoints"
    r = run_module("core.train", "--config", str(cfg), "--train.steps=2")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_module("core.train", "--config", str(cfg), "--optimizer.lr=1e6", "--train.max_nonfinite_steps=0")
    assert r.returncode == 3, r.stderr[-2000:]
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "diverged"
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} is not JSON")) for line in lines]
    assert any(row.get("not_finite") == {"grad_norm": "NaN"} and row["grad_norm"] is None for row in rows), lines

    kept = steps_in(root)
    newest = kept[-1]
    assert "step_000000002" in kept and newest != "step_000000002", kept  # the good checkpoint survives keep_latest = 1
    measured = weights_loss(root / newest)
    assert measured["2"] < measured["3"], measured  # step 3's weights (after the 1e6 update) measured worse
    before = str(int(newest.removeprefix("step_")) - 1)  # step 3 is pruned: its weights measured worse, neither lowest nor sound
    assert train_loss(root / newest) == pytest.approx(measured[before])  # train_loss: the steps before the save

    capsys.readouterr()
    assert plan.main(["--config", str(cfg)]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "diverged" in line]
    assert len(warning) == 1 and f"stopped as diverged at step {status['step']}" in warning[0], warning
    assert 'resume = "auto" goes back to step_000000002' in warning[0], warning
    capsys.readouterr()
    assert plan.main(["--config", str(cfg), f"--checkpoint.resume={root / newest}"]) == 0
    assert "diverged" not in capsys.readouterr().err  # an explicit resume is the user's choice: said no more

    r = run_module("core.train", "--config", str(cfg), "--train.steps=3")  # a sane LR again
    assert r.returncode == 0, r.stderr[-2000:]
    assert sum("goes back to step_000000002" in line for line in r.stderr.splitlines()) == 1, r.stderr[-2000:]
    assert list(weights_loss(root / "step_000000003")) == ["2"]  # the new step 3 continued from step 2
    (aside,) = (root / "abandoned").iterdir()
    assert newest in steps_in(aside), steps_in(aside)  # the diverged saves are kept, out of the way


def test_with_default_retention_an_update_that_blows_the_weights_up_never_prunes_the_sound_checkpoint(tmp_path):
    """Issue 34, item 1, with the default retention (every = 1, keep_latest = 1): two good steps, then
    an LR of 5e4, whose first update (step 3, its loss measured on step 2's sound weights) blows the
    weights up to about 5e4; the run ends diverged (exit 3). Step 3's save was labelled with a finite
    loss and pruned step 2; every restart resumed the blown-up weights. Now step 2 is held until a step
    measures the newer one, and that one measures worse: it survives, and the next start goes back to
    it, in one line that says which and why."""
    cfg = write_tiny_config(tmp_path, steps=12, body='[optimizer]\nlr = 0.3\n[lr_schedule]\nname = "constant"\n[checkpoint]\nevery = 1\nkeep_latest = 1\n')
    out, root = tmp_path / "out", tmp_path / "out" / "checkpoints"
    assert run_module("core.train", "--config", str(cfg), "--train.steps=2").returncode == 0
    assert steps_in(root) == ["step_000000002"]
    r = run_module("core.train", "--config", str(cfg), "--optimizer.lr=5e4")
    assert r.returncode == 3 and json.loads((out / "exit_status.json").read_text())["reason"] == "diverged", r.stderr[-2000:]
    kept = steps_in(root)
    assert kept[0] == "step_000000002" and len(kept) == 2, kept  # the sound one, and the newest
    measured = weights_loss(root / kept[-1])
    assert math.isfinite(measured["2"]) and (measured.get("3") is None or measured["3"] > measured["2"]), measured
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(root / kept[-1], tmp_path / "newest.pt")
    blown = max(float(t.abs().max()) for t in torch.load(tmp_path / "newest.pt", weights_only=True)["model"].values())
    assert blown > 1e4, blown  # the newest holds the blown-up weights
    r = run_module("core.train", "--config", str(cfg), "--train.steps=3", "--optimizer.lr=0.3")
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [line for line in r.stderr.splitlines() if "diverged" in line]
    assert 'resume = "auto" goes back to step_000000002' in line and "stopped as diverged at step" in line, line
    assert f"resumed from {root / 'step_000000002'} at step 2" in r.stdout + r.stderr
    assert list(weights_loss(root / "step_000000003")) == ["2"]  # step 3 trained again, from step 2


def test_a_run_that_diverged_before_any_sound_checkpoint_says_so(tmp_path, capsys):
    """An LR of 1e30 from the first step: step 1 is saved, step 2 is non-finite (exit 3). No later
    step measured step 1's weights, so no checkpoint is known to be from before the divergence: the
    next start says so in one line, and takes the newest."""
    from core.cli import plan

    cfg = write_tiny_config(tmp_path, steps=12, body='[optimizer]\nlr = 1e30\n[lr_schedule]\nname = "constant"\n[checkpoint]\nevery = 1\nkeep_latest = 1\n')
    r = run_module("core.train", "--config", str(cfg), "--train.max_nonfinite_steps=0")
    assert r.returncode == 3, r.stderr[-2000:]
    assert steps_in(tmp_path / "out" / "checkpoints") == ["step_000000001"]
    capsys.readouterr()
    assert plan.main(["--config", str(cfg)]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "diverged" in line]
    assert len(warning) == 1 and "no checkpoint is known to be from before the divergence" in warning[0], warning
    assert "takes the newest, step_000000001" in warning[0], warning


def test_a_removal_that_fails_part_way_leaves_what_it_had_not_looked_at(tmp_path):
    """A file or folder of a checkpoint that cannot be deleted (an I/O error; here its ``rng`` folder is
    a mount point, so removing it fails with EBUSY) must not make the folder be deleted whole, the
    user's notes beside the shards with it: the file-by-file removal stops there, the folder stays (without its marker, for the next prune) and nothing unseen goes."""
    from conftest import PY, in_a_small_disk

    folder = tmp_path / "step_000000004"
    (folder / "rng").mkdir(parents=True)
    for name in ("COMMITTED", "LINEAGE", "state.json", "__0_0.distcp", "notes.txt"):
        (folder / name).write_text("x")
    remove = f"{PY} -c 'from pathlib import Path; from core.checkpoint.retention import remove; remove(Path(\"{folder}\"))'"
    done = in_a_small_disk("1m", folder / "rng", f"touch '{folder}/rng/rank_0.json' && {remove} && ls -A '{folder}'")
    if done is None:
        pytest.skip("this machine may not mount a tmpfs, even in a namespace of its own (unshare -m / -rm)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "notes.txt" in done.stdout.split() and "COMMITTED" not in done.stdout.split(), done.stdout
    assert (folder / "notes.txt").read_text() == "x"
