"""core.report writes every artifact from a real run."""

from __future__ import annotations

import csv
import json

import torch
from conftest import run_here, run_module


def test_report_writes_every_artifact(tiny_config, tmp_path):
    cfg = tiny_config(steps=4)
    proc = run_module("core.train", "--config", str(cfg), "--validation.every=2", "--validation.batches=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "report"
    proc = run_module("core.report", "--run", str(tmp_path / "out"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout.splitlines() + proc.stderr.splitlines()  # the tools speak as the trainer does
    assert said and all(line.startswith("plait: ") for line in said), said
    for name in ("manifest.json", "metrics.csv", "loss-curve.png", "gradnorm-curve.png", "throughput.png", "final.safetensors"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:4] == b"\x89PNG"
    m = json.loads((out / "manifest.json").read_text())
    assert m["seed"] == 42 and m["world_size"] == 1 and m["steps"] == 4 and len(m["config_sha256"]) == 64
    assert m["versions"]["torch"] == torch.__version__ and m["best_val_loss"] is not None
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert {"step", "kind", "name", "value"} == set(rows[0])
    assert [r["value"] for r in rows if r["name"] == "loss" and r["kind"] == "train"].__len__() == 4
    assert any(r["name"] == "val_loss" for r in rows)
    from safetensors.torch import load_file

    from core.weights import checkpoint_model

    _, _, model = checkpoint_model(tmp_path / "out" / "checkpoints" / "step_000000004")
    final = load_file(str(out / "final.safetensors"))
    for k, v in model.state_dict().items():
        assert torch.equal(final[k], v), k


def test_report_follows_the_branch_a_resume_from_an_older_checkpoint_keeps(tiny_config, tmp_path):
    cfg = tiny_config(steps=12, body="[checkpoint]\nevery = 3\n")
    assert run_module("core.train", "--config", str(cfg)).returncode == 0
    older = tmp_path / "out" / "checkpoints" / "step_000000006"
    proc = run_module("core.train", "--config", str(cfg), f"--checkpoint.resume={older}", "--train.steps=9", "--optimizer.lr=1e-4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert {"kind": "resume", "step": 6, "tokens_seen": 6 * 1024} in lines
    new_branch = {r["step"]: r["loss"] for r in lines[lines.index({"kind": "resume", "step": 6, "tokens_seen": 6 * 1024}) :] if r["kind"] == "train"}
    out = tmp_path / "report"
    proc = run_here("core.report", "--run", str(tmp_path / "out"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads((out / "manifest.json").read_text())
    assert m["steps"] == 9 and m["final_loss"] == new_branch[9]  # not the left branch's step 12
    rows = [r for r in csv.DictReader((out / "metrics.csv").open()) if r["name"] == "loss" and r["kind"] == "train"]
    assert [int(r["step"]) for r in rows] == list(range(1, 10))
    assert [float(r["value"]) for r in rows[6:]] == [new_branch[s] for s in (7, 8, 9)]


def test_report_skips_a_damaged_metrics_line_and_names_a_damaged_final_checkpoint(tiny_config, tmp_path):
    """A byte of metrics.jsonl damaged on disk (not UTF-8) spoils its own line, never the report; a final
    checkpoint whose state.json holds a train state of the wrong type is one line and exit 2, never a
    traceback (UnicodeDecodeError, AttributeError)."""
    cfg = tiny_config(steps=3)
    assert run_module("core.train", "--config", str(cfg)).returncode == 0
    metrics = tmp_path / "out" / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(b"".join(lines[:1] + [b'{"kind": "train", "step": 9, "loss": \xff\xfe}\n'] + lines[1:]))
    out = tmp_path / "report"
    proc = run_here("core.report", "--run", str(tmp_path / "out"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in csv.DictReader((out / "metrics.csv").open()) if r["name"] == "loss" and r["kind"] == "train"]
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    final = tmp_path / "out" / "checkpoints" / "step_000000003"
    state = json.loads((final / "state.json").read_text())
    state["train"] = []  # a writer's bug, committed as it is
    (final / "state.json").write_text(json.dumps(state))
    from core.checkpoint.folders import manifest_files

    manifest = json.loads((final / "COMMITTED").read_text())
    manifest.update(manifest_files(final, exclude="COMMITTED", known={}))
    (final / "COMMITTED").write_text(json.dumps(manifest))
    proc = run_here("core.report", "--run", str(tmp_path / "out"), "--out", str(tmp_path / "report2"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"plait: error: {final / 'state.json'}: 'train' is a list, expected dict"], proc.stderr


def test_report_on_a_folder_that_is_not_a_run(tmp_path):
    proc = run_module("core.report", "--run", str(tmp_path), "--out", str(tmp_path / "r"))
    assert proc.returncode == 2 and "config.resolved.toml not found" in proc.stderr


def test_report_finds_the_final_checkpoint_of_a_relative_checkpoint_dir_from_anywhere(tiny_config, tmp_path, monkeypatch, capsys):
    """``checkpoint.dir = "ck"`` is relative to where the run started; the report looked for it relative to
    where the report ran, found nothing and wrote a manifest with ``"final_checkpoint": null`` and no
    final.safetensors, exit 0. run_info.json names the folder, absolute."""
    from core.cli.report import main

    (tmp_path / "start").mkdir()
    proc = run_module("core.train", "--config", str(tiny_config(steps=2)), "--checkpoint.dir=ck", cwd=tmp_path / "start")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["--run", str(tmp_path / "out"), "--out", str(tmp_path / "report")]) == 0
    m = json.loads((tmp_path / "report" / "manifest.json").read_text())
    assert m["final_checkpoint"] == str(tmp_path / "start" / "ck" / "step_000000002")
    assert (tmp_path / "report" / "final.safetensors").is_file()
