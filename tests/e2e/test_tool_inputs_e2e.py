"""Bad input to the commands (train, export, report) run as commands: one ``plait: error:`` line naming the
flag, key or file, exit code 2, no traceback: an output folder that cannot be written, an export or
report into a checkpoint folder, an export shard size that is not finite and positive, damaged run
files to report on (a metrics line that is not an object is skipped)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_here, run_module, write_tiny_config
from shared import one_document, one_line_error


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One tiny trained run, shared: its output folder (with one committed checkpoint)."""
    tmp = tmp_path_factory.mktemp("run")
    proc = run_module("core.train", "--config", str(write_tiny_config(tmp, steps=2)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tmp / "out"


@pytest.fixture
def checkpoint(run_dir) -> Path:
    return next((run_dir / "checkpoints").glob("step_*"))


@pytest.fixture
def corpus(tmp_path) -> Path:
    return one_document(tmp_path)


# --- output paths -------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["file", "proc"])
def test_output_folder_that_cannot_be_written(tmp_path, corpus, checkpoint, run_dir, where):
    if where == "file":
        out = tmp_path / "a-file"
        out.write_text("")
    else:
        out = Path("/proc/plait-test")
    cases = [
        ("core.export", "--checkpoint", str(checkpoint), "--format", "safetensors"),
        ("core.report", "--run", str(run_dir)),
        ("plugins.data.prepare", "--input", str(corpus), "--workers", "1"),
    ]
    for module, *args in cases:
        one_line_error(run_here(module, *args, "--out", str(out)), "--out", str(out))


def test_an_export_or_report_into_a_checkpoint_folder_is_refused(run_dir, checkpoint, capsys):
    """Pruning deletes a checkpoint folder whole: an export written into it (``--out <step folder>/hf``,
    to keep it beside its weights) was deleted without a word when the run pruned that step."""
    from core.cli import export, report

    for main, args in [
        (export.main, ["--checkpoint", str(checkpoint), "--format", "hf", "--out", str(checkpoint / "hf")]),
        (export.main, ["--checkpoint", str(checkpoint), "--format", "safetensors", "--out", str(checkpoint)]),
        (report.main, ["--run", str(run_dir), "--out", str(checkpoint / "report")]),
    ]:
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and f"lies in the checkpoint folder {checkpoint}, which pruning deletes whole" in err, err
    assert sorted(p.name for p in checkpoint.iterdir() if p.suffix in (".json", ".safetensors", ".csv") or p.name in ("hf", "report")) == ["state.json"]


@pytest.mark.parametrize("value", ["nan", "inf", "0"])
def test_export_shard_gb_must_be_finite_and_positive(tmp_path, checkpoint, value):
    out = tmp_path / "hf"
    proc = run_here("core.export", "--checkpoint", str(checkpoint), "--format", "hf", "--out", str(out), "--shard-gb", value)
    one_line_error(proc, "--shard-gb", "finite number > 0")
    assert not out.exists()


# --- damaged run files --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, damage, expected",
    [
        ("run_info.json", "{not json", "not readable JSON"),
        ("config.resolved.toml", "[train\nsteps = = 2\n", "not readable TOML"),
    ],
)
def test_report_on_damaged_run_files(tmp_path, run_dir, name, damage, expected):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("checkpoints"))
    (run / name).write_text(damage)
    proc = run_here("core.report", "--run", str(run), "--out", str(tmp_path / "report"))
    one_line_error(proc, str(run / name), expected)
    assert not (tmp_path / "report").exists()


def test_report_skips_a_metrics_line_that_is_not_an_object(tmp_path, run_dir):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("checkpoints"))
    with (run / "metrics.jsonl").open("a") as f:
        f.write("[1]\n42\n")
    proc = run_here("core.report", "--run", str(run), "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "report" / "manifest.json").read_text())["steps"] == 2
