"""Spike rehearsal: an injected spike is detected and handled by each action."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_spikes_in_a_row_count_through_rollbacks_and_only_for_skip_and_rollback():
    from core.contract.protocols import DistInfo
    from core.contract.run import Run
    from plugins.monitors.spikes import Spikes, SpikesOptions

    def feed(action: str, limit: int, restore: bool) -> tuple[list, Run]:
        run = Run(config={}, output_dir=Path("."), dist=DistInfo(), total_steps=100, tokens_per_step=8)
        monitor = Spikes(SpikesOptions(window=5, min_steps=5, action=action, max_in_a_row=limit))
        monitor.plait_train_start(run)
        verdicts = [monitor.plait_before_update(run, s, 3.0 + 0.01 * (s % 2), 1.0) for s in range(1, 7)]
        saved = dict(run.state)  # what a checkpoint of step 6 holds
        for s in range(7, 20):
            verdicts.append(monitor.plait_before_update(run, s, 9.0, 1.0))  # a new level
            if restore:  # a rollback restores the checkpoint's run.state
                run.state = dict(saved)
        return verdicts, run

    verdicts, run = feed("rollback", 4, restore=True)
    assert verdicts[6:9] == ["rollback"] * 3 and verdicts[9] == "skip"  # the 4th in a row: stop, weights as they are
    assert run.stop is not None and run.stop.exit_code == 3 and run.stop.checkpoint and "4 spikes in a row up to step 10" in run.stop.reason
    verdicts, run = feed("skip", 0, restore=False)
    assert verdicts[6:] == ["skip"] * 13 and run.stop is None  # 0: never stops
    verdicts, run = feed("log", 3, restore=False)
    assert verdicts[6:] == [None] * 13 and run.stop is None  # log applies every update: nothing to stop


# -- in-process: the rehearsal monitor and the plait_replace_batch hook ------------------------


def test_rehearsal_replaces_each_step_once_and_stops_after_its_steps():
    import torch

    from core.contract.protocols import DistInfo
    from core.contract.run import Run
    from core.loop.monitor_hub import MonitorHub
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

    from core.contract.hookspecs import hookimpl
    from core.contract.protocols import DistInfo
    from core.contract.run import Run
    from core.loop.monitor_hub import MonitorHub

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


def test_a_replacement_with_ids_outside_the_vocabulary_or_a_wrong_verdict_is_a_monitor_failure(capsys):
    """What a monitor returns is held to its hook's contract: token ids below the vocabulary (an id past
    it was an IndexError deep in the model, naming no monitor), and a verdict of None, "skip" or
    "rollback" (anything else was ignored)."""
    import torch

    from core.contract.hookspecs import hookimpl
    from core.contract.protocols import DistInfo
    from core.contract.run import Run
    from core.loop.monitor_hub import MonitorHub

    class Far:
        @hookimpl
        def plait_replace_batch(self, inputs, labels):
            return inputs + 100_000, labels

    class FloatIds:
        @hookimpl
        def plait_replace_batch(self, inputs, labels):
            return inputs.float(), labels

    class Ignored:  # labels of -100 are ignored by the loss: allowed
        @hookimpl
        def plait_replace_batch(self, inputs, labels):
            return inputs, torch.full_like(labels, -100)

    class Explode:
        @hookimpl
        def plait_before_update(self):
            return "explode"

    real = torch.zeros(2, 4, dtype=torch.long)
    for monitor, hook, expected in [
        (Far(), "plait_replace_batch", "returned token ids from 0 to 100000; expected ids in 0..511"),
        (FloatIds(), "plait_replace_batch", "returned tensors of torch.float32 and torch.int64; expected integer token ids"),
        (Explode(), "plait_before_update", "returned 'explode'; expected None, 'skip' or 'rollback'"),
    ]:
        run = Run(config={}, output_dir=Path("."), dist=DistInfo(), total_steps=5, tokens_per_step=8)
        args = {"inputs": real, "labels": real, "micro": 0} if hook == "plait_replace_batch" else {"loss": 1.0, "grad_norm": 1.0}
        assert MonitorHub([("m", monitor)], vocab_size=512).emit(hook, run=run, step=1, **args) == [None]
        assert f"monitor 'm' failed in {hook}:" in (err := capsys.readouterr().err) and expected in err, err
        assert run.stop is not None and run.stop.exit_code == 4
    run = Run(config={}, output_dir=Path("."), dist=DistInfo(), total_steps=5, tokens_per_step=8)
    (kept,) = MonitorHub([("m", Ignored())], vocab_size=512).emit("plait_replace_batch", run=run, step=1, micro=0, inputs=real, labels=real)
    assert kept is not None and run.stop is None


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
