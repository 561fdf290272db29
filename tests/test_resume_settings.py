"""A resumed run trains with its own config's optimizer settings, not the checkpoint's, and says which changed.

Before checkpointing/hyperparams.py, DCP's optimizer load restored every param-group setting as saved:
``--optimizer.lr=...`` on a resumed run was silently ignored, and a checkpoint saved with
``impl = "foreach"`` crashed a resume under the fused default (``found_inf`` reached the foreach kernel).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, read_metrics, run_module, write_tiny_config

NOTE = "the optimizer settings it holds differ from this run's"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Two 4-step runs (one with the fused AdamW kernel, one with foreach), each with its checkpoint of step 4."""
    root = tmp_path_factory.mktemp("resume_settings")
    runs = {}
    for impl in ("fused", "foreach"):
        (root / impl).mkdir()
        cfg = write_tiny_config(root / impl, body="[checkpoint]\nevery = 2\n")
        proc = run_module("core.train", "--config", str(cfg), "--train.steps=4", f"--optimizer.impl={impl}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[impl] = cfg
    return runs


def resume(saved: dict[str, Path], impl: str, tmp_path: Path, *overrides: str, steps: int = 6):
    """Copy run ``impl`` to ``tmp_path`` and resume it to ``steps`` with ``overrides``; (process, metrics after step 4)."""
    src = saved[impl].parent
    shutil.copytree(src / "out", tmp_path / "out")
    cfg = tmp_path / "run.toml"
    cfg.write_text(saved[impl].read_text().replace(str(src / "out"), str(tmp_path / "out")))
    proc = run_module("core.train", "--config", str(cfg), f"--train.steps={steps}", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    return proc, [r for r in read_metrics(tmp_path / "out") if r["step"] > 4]


def test_a_new_learning_rate_applies_on_resume_and_is_named(saved, tmp_path):
    _, same = resume(saved, "fused", tmp_path / "same")
    proc, new = resume(saved, "fused", tmp_path / "new", "--optimizer.lr=0.01")
    assert proc.stderr.count(NOTE) == 1 and "peak lr 0.0003 -> 0.01" in proc.stderr
    # and the config line names every value that differs from the checkpoint's config
    line = next(x for x in proc.stderr.splitlines() if "the config differs from the one it was saved with" in x)
    assert "optimizer.lr 0.0003 -> 0.01" in line and "train.steps 4 -> 6" in line  # (and the copied output_dir)
    assert [r["step"] for r in new] == [5, 6]
    for a, b in zip(same, new):  # the schedule's multiplier is the same; the peak is the config's
        assert b["lr"] == pytest.approx(a["lr"] * 0.01 / 0.0003, rel=1e-6)
    assert new[0]["loss"] == same[0]["loss"]  # step 5's loss is computed before its update
    assert new[1]["loss"] != same[1]["loss"]  # step 6 sees the update made with the new LR


def test_an_unchanged_config_resumes_without_a_note(saved, tmp_path):
    proc, rows = resume(saved, "fused", tmp_path)
    assert NOTE not in proc.stderr and "train.seed" not in proc.stderr
    assert [r["step"] for r in rows] == [5, 6]


def test_a_foreach_checkpoint_resumes_with_the_fused_default(saved, tmp_path):
    proc, rows = resume(saved, "foreach", tmp_path)
    assert NOTE in proc.stderr and "fused None -> True" in proc.stderr
    assert [r["step"] for r in rows] == [5, 6]


def test_another_seed_on_resume_is_a_warning_naming_both(saved, tmp_path):
    proc, _ = resume(saved, "fused", tmp_path, "--train.seed=7")
    assert proc.stderr.count("was trained with train.seed = 42, this run uses 7") == 1


def test_a_checkpoint_past_train_steps_says_there_is_nothing_to_train(saved, tmp_path):
    proc, rows = resume(saved, "fused", tmp_path, steps=3)
    assert "nothing to train: the run is at step 4 and train.steps is 3" in proc.stdout
    assert "training steps" not in proc.stdout and rows == []


def test_training_data_rebuilt_under_the_same_path_is_a_warning_on_resume(tmp_path):
    corpus = tmp_path / "corpus"
    shutil.copytree(REPO / "plugins" / "data" / "corpus" / "shakespeare", corpus)
    cfg = write_tiny_config(tmp_path, body="[checkpoint]\nevery = 2\n")
    args = ("core.train", "--config", str(cfg), f"--data.path={corpus}")
    first = run_module(*args, "--train.steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    same = run_module(*args, "--train.steps=5")  # the same data: nothing to say
    assert same.returncode == 0 and "trained on other data" not in same.stderr, same.stderr[-3000:]
    train = corpus / "train.bin"
    train.write_bytes(train.read_bytes()[: 2 * 400_000])  # rebuilt in place: same path, other tokens ...
    meta = json.loads((corpus / "meta.json").read_text())
    meta["tokens"]["train"] = 400_000  # ... and its meta.json with them, as prepare writes it
    (corpus / "meta.json").write_text(json.dumps(meta))
    rebuilt = run_module(*args, "--train.steps=6")
    assert rebuilt.returncode == 0, rebuilt.stderr[-3000:]
    line = next(x for x in rebuilt.stderr.splitlines() if "was trained on other data" in x)
    assert "train.bin 800000 bytes uint16" in line and "the restored data position (sample 40) now indexes different data" in line
