"""``python -m core.plan`` names the checkpoint a run would resume and what changed since."""

from __future__ import annotations

from shared import plan_json, plan_text


def test_plan_names_the_checkpoint_it_would_resume_and_what_changed_since(tiny_config, capsys, tmp_path):
    from conftest import run_module

    cfg = tiny_config(body="[checkpoint]\nevery = 2\n")
    proc = run_module("core.train", "--config", str(cfg), "--train.steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = plan_text(capsys, "--config", str(cfg), "--train.steps=6", "--optimizer.lr=0.01")
    assert f"resume      from {tmp_path / 'out' / 'checkpoints' / 'step_000000004'} (step 4 of 6)" in text
    assert "config changed since: optimizer.lr 0.0003 -> 0.01" in text and "config changed since: train.steps 4 -> 6" in text
    resume = plan_json(capsys, "--config", str(cfg), "--train.steps=4")["resume"]
    assert resume["step"] == 4 and resume["config_changes"] == [] and resume["sets_aside"] == []
    older = tmp_path / "out" / "checkpoints" / "step_000000002"
    text = plan_text(capsys, "--config", str(cfg), f"--checkpoint.resume={older}")
    assert "a new branch: the 1 later checkpoint(s), step_000000004 to step_000000004, move to abandoned/" in text
    assert "checkpoint.resume" not in text  # naming a checkpoint is not a config change
    assert (tmp_path / "out" / "checkpoints" / "step_000000004" / "COMMITTED").is_file()  # plan moves nothing
