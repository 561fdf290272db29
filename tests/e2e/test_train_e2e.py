"""End-to-end runs through the real commands: torchrun on 2 CPU ranks, determinism, resolved config."""

from __future__ import annotations

import json

import pytest
from conftest import read_metrics, run_module, torchrun

from core.config import files as config


@pytest.mark.slow
def test_torchrun_two_ranks_loss_falls(tiny_config, tmp_path):
    cfg = tiny_config(steps=30, global_batch_tokens=2048, body="[optimizer]\nlr = 3e-3\n[lr_schedule]\nwarmup_steps = 5\n")
    proc = torchrun(2, "--config", str(cfg), "--train.log_every=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.8, [r["loss"] for r in rows]
    for key in ("loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s", "step_time_s"):
        assert key in rows[-1]
    assert rows[-1]["tokens_seen"] == 30 * 2048
    info = json.loads((out / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["backend"] == "gloo"
    resolved = config.tomllib.loads((out / "config.resolved.toml").read_text())
    assert resolved["optimizer"]["lr"] == 3e-3 and resolved["train"]["log_every"] == 5
    assert resolved["derived"]["grad_accum"] == 4  # 2048 / (2 micro x 128 seq x 2 ranks)
    assert resolved["model"]["name"] == "llama3" and resolved["data"]["seq_len"] == 128


def test_same_seed_same_losses_and_world_size_independent(tiny_config, tmp_path):
    losses = []
    for i in range(2):
        cfg = tiny_config(name=f"r{i}.toml", steps=4)
        proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={tmp_path / f'o{i}'}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses.append([r["loss"] for r in read_metrics(tmp_path / f"o{i}")])
    assert losses[0] == losses[1] and len(losses[0]) == 4
    other = tiny_config(name="seed.toml", steps=4)
    proc = run_module("core.train", "--config", str(other), f"--train.output_dir={tmp_path / 'o3'}", "--train.seed=7")
    assert proc.returncode == 0
    assert [r["loss"] for r in read_metrics(tmp_path / "o3")] != losses[0]


def _failing_monitor_site(tmp_path, hook: str):
    site = tmp_path / "site"
    pkg = site / "failing_monitor"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from dataclasses import dataclass\n"
        "from core.contract.hookspecs import hookimpl\n"
        "@dataclass\nclass Opts:\n    pass\n"
        "class Boom:\n    def __init__(self, options):\n        pass\n"
        f"    @hookimpl\n    def {hook}(self, run, step, metrics):\n        raise ValueError('sensor on fire')\n"
        "@hookimpl\ndef plait_register(registry):\n"
        "    registry.add('monitor', 'boom', Boom, options=Opts, doc='raises')\n"
    )
    dist = site / "failing_monitor-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: failing-monitor\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[plait]\nboom = failing_monitor\n")
    import os

    return {"PYTHONPATH": str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.parametrize("on_error", ["stop", "continue"])
def test_a_monitor_that_raises_is_named_and_handled(tiny_config, tmp_path, on_error):
    cfg = tiny_config(steps=4)
    env = _failing_monitor_site(tmp_path, "plait_step_end")
    proc = run_module("core.train", "--config", str(cfg), '--monitors.enabled=["jsonl", "boom"]', f"--monitors.on_error={on_error}", extra_env=env)
    assert "monitor 'boom' failed in plait_step_end: ValueError: sensor on fire" in proc.stderr
    assert "Traceback" not in proc.stderr
    steps = [r["step"] for r in read_metrics(tmp_path / "out")]
    if on_error == "stop":
        assert proc.returncode == 4 and steps == [1]
        assert (tmp_path / "out" / "checkpoints" / "step_000000001" / "COMMITTED").exists()
    else:
        assert proc.returncode == 0 and steps == [1, 2, 3, 4]


def test_start_summary_and_resume_line_say_what_is_active_and_restored(tiny_config, tmp_path):
    cfg = tiny_config(steps=2)
    first = run_module("core.train", "--config", str(cfg))
    assert first.returncode == 0, first.stderr[-2000:]
    assert "plait: model llama3," in first.stdout and "precision fp32" in first.stdout
    assert "compile off" in first.stdout and "tokens/step | steps 0 -> 2" in first.stdout
    again = run_module("core.train", "--config", str(cfg), "--train.steps=3", '--checkpoint.exclude_from_loading=["optimizer"]')
    assert again.returncode == 0, again.stderr[-2000:]
    line = next(x for x in again.stdout.splitlines() if x.startswith("plait: restored"))
    assert "tokens seen" in line and "lr " in line and "data at sample" in line and "optimizer started fresh" in line
