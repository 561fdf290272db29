"""A resumed run trains with its own config's optimizer settings, not the checkpoint's, and says which changed.

Before core/checkpoint/resume.py, DCP's optimizer load restored every param-group setting as saved:
``--optimizer.lr=...`` on a resumed run was silently ignored, and a checkpoint saved with
``impl = "foreach"`` crashed a resume under the fused default (``found_inf`` reached the foreach kernel).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, read_metrics, run_module, write_tiny_config
from shared import stream_docs

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


def test_target_tokens_counts_tokens_when_a_resume_changes_the_batch(saved, tmp_path):
    """train.target_tokens over this run's batch alone set the length: a run resumed at step 4 (4,096 tokens
    of 8,192) with twice the batch "ended" at once, "nothing to train: the run is at step 4 and train.steps
    is 4", exit 0, half its tokens short. It ends once the tokens still to go are trained at the new batch."""
    proc, rows = resume(saved, "fused", tmp_path, "--train.target_tokens=8192", "--train.global_batch_tokens=2048", steps=0)
    assert "steps 4 -> 6" in proc.stdout, proc.stdout[-2000:]
    assert [r["step"] for r in rows] == [5, 6] and rows[-1]["tokens_seen"] == 8192


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


def one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("plait: ")]
    assert len(lines) == 1 and lines[0].startswith("plait: error: ") and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "training steps" not in proc.stdout
    return lines[0]


def untouched(ckpts: Path):
    """The checkpoint folder's listing and CURRENT_RUN, to compare after a refused start."""
    return sorted(p.name for p in ckpts.iterdir()), (ckpts / "CURRENT_RUN").read_text()


def test_a_stream_cannot_continue_the_global_position_of_an_indexed_source(saved, tmp_path):
    """A resume that switches token_bin for text_stream is refused before training, in one line: taking
    every checkpoint of the run for damaged would start afresh under a new lineage, which no restart
    would undo."""
    src = saved["fused"].parent
    shutil.copytree(src / "out", tmp_path / "out")
    before = untouched(tmp_path / "out" / "checkpoints")
    cfg = tmp_path / "run.toml"
    cfg.write_text(saved["fused"].read_text().replace(str(src / "out"), str(tmp_path / "out")))
    proc = run_module("core.train", "--config", str(cfg), "--train.steps=6", "--data.name=text_stream", f'--data.files=["{stream_docs(tmp_path)}"]')
    line = one_error_line(proc)
    assert "the checkpoint holds the global data position of data source 'token_bin' (sample 32), not a stream's position" in line, line
    assert untouched(tmp_path / "out" / "checkpoints") == before


def test_an_indexed_source_cannot_continue_the_positions_of_a_stream(tmp_path):
    """The other way round the load itself found it (KeyError: 'consumed_samples'), and that too was
    taken for damage: every checkpoint skipped, a fresh start. A load that fails because this config
    cannot continue the checkpoint (a ConfigError or DataError) ends the run with exit code 2 now."""
    cfg = write_tiny_config(tmp_path, body="[checkpoint]\nevery = 2\n")
    first = run_module("core.train", "--config", str(cfg), "--train.steps=2", "--data.name=text_stream", f'--data.files=["{stream_docs(tmp_path)}"]')
    assert first.returncode == 0, first.stderr[-3000:]
    before = untouched(tmp_path / "out" / "checkpoints")
    proc = run_module("core.train", "--config", str(cfg), "--train.steps=4")  # token_bin, as the file says
    line = one_error_line(proc)
    assert "step_000000002 holds the per-rank stream positions of data source 'text_stream'; this run's data source 'token_bin'" in line, line
    assert untouched(tmp_path / "out" / "checkpoints") == before


def test_the_config_line_names_config_not_what_plait_derived_from_it():
    """A resume on another world size listed ``derived.world_size`` and ``derived.grad_accum`` as
    config that "differs": plait writes them into config.resolved.toml for the reader, nobody sets them."""
    from core.checkpoint.resume import config_differences

    saved = {"train": {"steps": 4, "seed": 1}, "derived": {"world_size": 2, "grad_accum": 2}}
    now = {"train": {"steps": 6, "seed": 2}, "derived": {"world_size": 1, "grad_accum": 4}}
    assert config_differences(saved, now) == ["train.steps 4 -> 6"]
