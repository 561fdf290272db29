"""Spike rehearsal: an injected spike is detected and handled by each action."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import read_metrics, run_module

pytestmark = pytest.mark.slow


def rehearse(tiny_config, tmp_path, action):
    cfg = tiny_config(steps=20)
    proc = run_module(
        "core.train",
        "--config",
        str(cfg),
        "--optimizer.lr=3e-3",
        '--monitors.enabled=["console", "jsonl", "spikes", "spike_rehearsal"]',
        "--monitors.spike_rehearsal.at_step=15",
        f"--monitors.spikes.action={action}",
        "--monitors.spikes.window=5",
        "--monitors.spikes.min_steps=5",
        "--checkpoint.every=5",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("injected spike batch") >= 5
    return proc


def test_log_only_reports(tiny_config, tmp_path):
    proc = rehearse(tiny_config, tmp_path, "log")
    assert "spikes: step 15: spike in loss" in proc.stderr and "action: log" in proc.stderr
    assert "update skipped" not in proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "out")][-1] == 20


def test_skip_drops_the_spiking_updates(tiny_config, tmp_path):
    proc = rehearse(tiny_config, tmp_path, "skip")
    assert proc.stdout.count("update skipped") == 5  # the five injected steps, nothing else
    for step in range(15, 20):
        assert f"plait: step {step}: update skipped" in proc.stdout
    rows = {r["step"]: r for r in read_metrics(tmp_path / "out")}
    assert rows[20]["loss"] < rows[15]["loss"] - 1.0  # the weights never took the spike


def test_rollback_restores_and_skips_the_data(tiny_config, tmp_path):
    proc = rehearse(tiny_config, tmp_path, "rollback")
    assert "rolled back to step_000000010" in proc.stdout
    state = json.loads((tmp_path / "out" / "checkpoints" / "step_000000020" / "state.json").read_text())
    per_step = 1024 // 128
    # 20 steps trained, plus the batches skipped by the rollbacks
    assert state["step"] == 20 and state["data"]["consumed_samples"] > 20 * per_step


# -- in-process: the rehearsal monitor and the plait_replace_batch hook ------------------------


def test_rehearsal_replaces_each_step_once_and_stops_after_its_steps():
    import torch

    from core.monitor_hub import MonitorHub
    from core.protocols import DistInfo
    from core.run import Run
    from plugins.monitors.spike_rehearsal import SpikeRehearsal, SpikeRehearsalOptions

    class Spec:
        vocab_size = 1000

    run = Run(config={"train": {"seed": 3}}, output_dir=Path("."), dist=DistInfo(), total_steps=50, tokens_per_step=8, spec=Spec())
    hub = MonitorHub([("spike_rehearsal", SpikeRehearsal(SpikeRehearsalOptions(at_step=4, steps=2)))])
    real = torch.zeros(2, 4, dtype=torch.long)

    def replaced(step: int) -> list[bool]:
        out = hub.emit("plait_replace_batch", run=run, step=step, micro=0, inputs=real, labels=real)
        out += hub.emit("plait_replace_batch", run=run, step=step, micro=1, inputs=real, labels=real)
        for pair in out:
            if pair is not None:
                assert pair[0].shape == real.shape and int(pair[0].min()) >= 990 and torch.equal(pair[0][:, 1:], pair[1][:, :-1])
        return [pair is not None for pair in out]

    assert replaced(3) == [False, False]
    assert replaced(4) == [True, True]  # every micro-batch of the step
    assert replaced(4) == [False, False]  # a rollback brought step 4 back: not replayed
    assert replaced(5) == [True, True]
    assert replaced(6) == [False, False]  # two steps rehearsed: done
    again = SpikeRehearsal(SpikeRehearsalOptions(at_step=4, steps=2))
    a = again.plait_replace_batch(run, 4, 0, real)
    b = SpikeRehearsal(SpikeRehearsalOptions(at_step=4, steps=2)).plait_replace_batch(run, 4, 0, real)
    assert a is not None and b is not None and torch.equal(a[0], b[0])  # a function of (seed, step, rank, micro)


def test_a_replacement_of_the_wrong_shape_is_a_monitor_failure(capsys):
    import torch

    from core.hookspecs import hookimpl
    from core.monitor_hub import MonitorHub
    from core.protocols import DistInfo
    from core.run import Run

    class Wrong:
        @hookimpl
        def plait_replace_batch(self, inputs):
            return inputs[:, :2], inputs[:, :2]

    run = Run(config={}, output_dir=Path("."), dist=DistInfo(), total_steps=5, tokens_per_step=8)
    real = torch.zeros(2, 4, dtype=torch.long)
    assert MonitorHub([("wrong", Wrong())]).emit("plait_replace_batch", run=run, step=1, micro=0, inputs=real, labels=real) == [None]
    assert (
        "monitor 'wrong' failed in plait_replace_batch: TypeError: returned tuple; expected None or (inputs, labels) shaped (2, 4)" in capsys.readouterr().err
    )
    assert run.stop is not None and run.stop.exit_code == 4
