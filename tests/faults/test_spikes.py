"""Spike rehearsal over real runs: an injected spike is detected and handled by each action
(log, skip, rollback), a lasting change of level stops the run, a rollback restores an async save in
flight or skips a checkpoint damaged after its commit, and a SIGTERM during rollbacks stops the run
at once with a checkpoint."""

from __future__ import annotations

import json

import pytest
from conftest import read_metrics, run_module

pytestmark = pytest.mark.slow


def spike_run(tiny_config, action: str, steps: int = 20, spike_steps: int = 5):
    """A run with the spikes monitor and ``spike_steps`` injected spike batches from step 15."""
    cfg = tiny_config(steps=steps)
    return run_module(
        "core.train",
        "--config",
        str(cfg),
        "--optimizer.lr=3e-3",
        '--monitors.enabled=["console", "jsonl", "spikes", "spike_rehearsal"]',
        "--monitors.spike_rehearsal.at_step=15",
        f"--monitors.spike_rehearsal.steps={spike_steps}",
        f"--monitors.spikes.action={action}",
        "--monitors.spikes.window=5",
        "--monitors.spikes.min_steps=5",
        "--checkpoint.every=5",
    )


def rehearse(tiny_config, tmp_path, action):
    proc = spike_run(tiny_config, action)
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


def test_a_lasting_change_of_level_stops_the_run_instead_of_skipping_forever(tiny_config, tmp_path):
    """Thirty steps of rare tokens: not a spike but a new level. Rather than skip every one of those
    updates (with a lasting change, every update of the run), the tenth in a row stops
    the run with exit code 3 and a checkpoint of the weights no spike reached."""
    proc = spike_run(tiny_config, "skip", steps=40, spike_steps=30)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stdout.count("update skipped") == 10
    status = json.loads((tmp_path / "out" / "exit_status.json").read_text())
    assert status["exit_code"] == 3 and status["step"] == 24 and "10 spikes in a row up to step 24" in status["detail"]
    saved = tmp_path / "out" / "checkpoints" / "step_000000024"
    assert (saved / "COMMITTED").is_file()
    state = json.loads((saved / "state.json").read_text())
    assert "spikes_window" not in state["train"] and state["train"]["spikes_in_a_row"] == 0  # a resume judges afresh


# a rehearsed spike at step 10 that the spikes monitor answers with a rollback; a checkpoint every 3 steps
ROLLBACK_AT_STEP_10 = (
    "--optimizer.lr=3e-3",
    '--monitors.enabled=["console", "jsonl", "spikes", "spike_rehearsal"]',
    "--monitors.spike_rehearsal.at_step=10",
    "--monitors.spike_rehearsal.steps=1",
    "--monitors.spikes.action=rollback",
    "--monitors.spikes.window=5",
    "--monitors.spikes.min_steps=5",
    "--checkpoint.every=3",
)


def test_a_rollback_while_an_async_save_is_in_flight_restores_that_save(tiny_config, tmp_path):
    """The spike comes at the step after an async save was started. The rollback listed this run's
    checkpoints before it waited for that save; the commit then pruned the older one it had chosen
    (keep_latest = 1), and the run died with 'checkpoint .../step_000000006 does not exist' (exit
    code 2, which launchers never retry). With more kept, it went back to that older checkpoint."""
    proc = run_module(
        "core.train",
        "--config",
        str(tiny_config(steps=11)),
        *ROLLBACK_AT_STEP_10,
        "--checkpoint.async=true",
        "--checkpoint.keep_latest=1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rolled back to step_000000009" in proc.stdout
    state = json.loads((tmp_path / "out" / "checkpoints" / "step_000000011" / "state.json").read_text())
    assert state["step"] == 11


def test_a_rollback_skips_a_checkpoint_damaged_after_its_commit(tiny_config, tmp_path):
    """A rollback loaded the newest checkpoint after checking only its small files: a shard damaged
    on disk since its commit (a flipped byte) went into the weights unnoticed, and every later save
    kept it. The rollback now checks the shards' checksums too (each rank a share) and falls back."""
    import os

    from conftest import REPO

    seams = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)]), "PLAIT_TEST_DAMAGE_AFTER_COMMIT": "9"}
    proc = run_module(
        "core.train",
        "--config",
        str(tiny_config(steps=10)),
        *ROLLBACK_AT_STEP_10,
        "--checkpoint.keep_latest=0",
        extra_env=seams,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rolled back to step_000000006" in proc.stdout, proc.stdout[-3000:]
    assert "step_000000009" in proc.stderr and "checksum" in proc.stderr.lower(), proc.stderr[-3000:]


def test_a_signal_during_rollbacks_stops_the_run_at_once(tmp_path):
    """A monitor that rolls back at every step (as a spike detector facing a new level does):
    a SIGTERM then must stop the run with a checkpoint, not wait for an ordinary step that never
    comes (the loop checks for a stop after a rollback too)."""
    import signal

    import torch
    from conftest import write_tiny_config

    from core.contract.hookspecs import hookimpl, register_monitor
    from core.contract.protocols import DistInfo
    from core.loop.trainer import Trainer
    from core.preflight.prepare import prepare

    cfg = write_tiny_config(tmp_path, steps=20)
    trainer = Trainer(prepare(str(cfg), ["--checkpoint.every=4"]), DistInfo(device=torch.device("cpu")))
    trainer.build()

    class AlwaysRollback:
        calls = 0

        @hookimpl
        def plait_before_update(self, run, step, loss, grad_norm):
            if step <= 5:
                return None  # train to step 5: a checkpoint at step 4
            self.calls += 1
            if self.calls == 3:
                trainer.signals.handle(signal.SIGTERM)  # as the handler does when the signal arrives
            if self.calls > 50:
                raise RuntimeError("the signal was never followed")
            return "rollback"

    monitor = AlwaysRollback()
    register_monitor(trainer.monitors.pm, "always_rollback", monitor)
    trainer.monitors.names.append("always_rollback")
    trainer.before_update_hooks = True
    assert trainer.fit() == 0
    assert monitor.calls == 3 and trainer.run.step == 4  # stopped right after the third rollback
    status = json.loads((tmp_path / "out" / "exit_status.json").read_text())
    assert status["reason"] == "signal" and status["step"] == 4
    assert (tmp_path / "out" / "checkpoints" / "step_000000004" / "COMMITTED").is_file()
