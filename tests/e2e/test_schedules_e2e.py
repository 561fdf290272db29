"""The LR a run logs is the LR its step applied."""

from __future__ import annotations


def test_logged_lr_is_the_lr_the_step_applied(tiny_config, tmp_path):
    from conftest import read_metrics, run_module

    from core.cli.lr_plot import lr_values
    from core.preflight.prepare import prepare

    cfg = tiny_config(steps=6)
    args = ["--lr_schedule.warmup_steps=4", "--optimizer.lr=1e-3"]
    r = run_module("core.train", "--config", str(cfg), *args)
    assert r.returncode == 0, r.stderr[-2000:]
    applied = lr_values(prepare(str(cfg), args, validate_data=False))  # the LR of each step, as plan draws it
    rows = read_metrics(tmp_path / "out")
    assert [round(row["lr"], 12) for row in rows] == [round(v, 12) for v in applied]
