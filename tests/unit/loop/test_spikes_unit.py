"""The spikes monitor and the spike rehearsal in this process: spikes in a row count through
rollbacks, and only for ``skip`` and ``rollback``; the rehearsal replaces each step's batch once and
stops after its steps; a replacement of the wrong shape, with ids outside the vocabulary or with a
wrong verdict is a monitor failure."""

from __future__ import annotations

from pathlib import Path


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
