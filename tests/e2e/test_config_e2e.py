"""Configs in real runs: a shipped config runs from another directory (its paths resolve against its
own folder), and a run's ``config.resolved.toml`` runs the same run again."""

from __future__ import annotations

import json

from core.config import files as config


def test_shipped_config_runs_from_another_directory(tmp_path):
    from conftest import REPO, read_metrics, run_module

    out = tmp_path / "out"
    r = run_module(
        "core.train",
        "--config",
        str(REPO / "train_configs" / "debug_cpu.toml"),
        "--train.steps=2",
        f"--train.output_dir={out}",
        "--data.seq_len=64",
        "--train.global_batch_tokens=512",
        "--train.micro_batch=8",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert read_metrics(out)[-1]["step"] == 2
    resolved = (out / "config.resolved.toml").read_text()
    assert f'path = "{REPO / "plugins" / "data" / "corpus" / "shakespeare"}"' in resolved


def test_resolved_config_reruns_the_run(tmp_path, monkeypatch, capsys):
    """config.resolved.toml is a complete config: training from it gives the same losses. Its output
    folders are absolute, so a run started with relative ones (``--train.output_dir=out``) and started
    again from its resolved config inside its own folder resumes instead of training afresh in ``out/out``."""
    from conftest import read_metrics, run_module, write_tiny_config

    from core.cli.plan import main

    cfg = write_tiny_config(tmp_path, steps=4, global_batch_tokens=512)
    first = tmp_path / "out"
    assert run_module("core.train", "--config", str(cfg), "--train.output_dir=out", "--checkpoint.dir=ck", cwd=tmp_path).returncode == 0
    resolved = config.tomllib.loads((first / "config.resolved.toml").read_text())
    assert resolved["train"]["output_dir"] == str(first) and resolved["checkpoint"]["dir"] == str(tmp_path / "ck")
    monkeypatch.chdir(first)
    assert main(["--config", "config.resolved.toml", "--train.steps=5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["resume"]["step"] == 4  # the same run, from its own folder
    again = tmp_path / "again"
    r = run_module("core.train", "--config", str(first / "config.resolved.toml"), f"--train.output_dir={again}", "--checkpoint.dir=@default")
    assert r.returncode == 0, r.stderr[-2000:]
    assert [row["loss"] for row in read_metrics(again)] == [row["loss"] for row in read_metrics(first)]
