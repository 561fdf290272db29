"""The mfu, memory and update_ratio monitors in this process: the hub merges what each monitor returns in
config order and refuses a result that is not a dict; update_ratio's ratio against one computed here
from a real AdamW step, on log steps only; mfu's arithmetic, with no guess on CPU; memory's state bytes
from a real AdamW step, and no device memory on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.contract.hookspecs import hookimpl
from core.contract.options import NoOptions
from core.contract.protocols import DistInfo
from core.contract.run import Run
from core.loop.monitor_hub import MonitorHub
from plugins.monitors import mfu as mfu_mod
from plugins.monitors.memory import Memory
from plugins.monitors.update_ratio import UpdateRatio


def make_run(optimizer=None, spec=None, log_every: int = 1, total_steps: int = 10) -> Run:
    return Run(
        config={}, output_dir=Path("."), dist=DistInfo(), total_steps=total_steps, tokens_per_step=64, spec=spec, optimizer=optimizer, log_every=log_every
    )


class Adds:
    def __init__(self, values, seen=None):
        self.values, self.seen = values, seen

    @hookimpl
    def plait_metrics(self, metrics):
        if self.seen is not None:
            self.seen.append(dict(metrics))
        return self.values


def test_hub_merges_in_config_order_and_later_monitors_see_earlier_ones():
    seen: list[dict] = []
    hub = MonitorHub([("a", Adds({"x": 1, "y": 1})), ("b", Adds({"y": 2}, seen)), ("c", Adds(None))])
    out = hub.metrics(make_run(), 1, {"loss": 3.0})
    assert out == {"loss": 3.0, "x": 1, "y": 2}
    assert seen == [{"loss": 3.0, "x": 1, "y": 1}]


def test_a_non_dict_result_disables_the_monitor_with_one_line(capsys):
    run = make_run()
    hub = MonitorHub([("bad", Adds([1, 2])), ("good", Adds({"z": 1}))], on_error="continue")
    assert hub.metrics(run, 1, {}) == {"z": 1}
    assert "monitor 'bad' failed in plait_metrics: TypeError: returned a list; expected a dict of metrics or None" in capsys.readouterr().err
    assert hub.metrics(run, 2, {}) == {"z": 1} and "bad" in hub.failed and run.stop is None
    stopping = MonitorHub([("bad", Adds("nope"))], on_error="stop")
    stopping.metrics(run, 3, {})
    assert run.stop is not None and run.stop.exit_code == 4


def test_update_ratio_measures_log_steps_only():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    groups = [
        {"params": [model[0].weight], "name": "matrix"},
        {"params": [model[0].bias, model[1].weight, model[1].bias], "name": "norm_and_bias"},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    run = make_run(opt, log_every=2)
    hub = MonitorHub([("update_ratio", UpdateRatio(NoOptions()))])
    hub.emit("plait_train_start", run=run)
    for step in (1, 2):
        before = [[p.detach().clone() for p in g["params"]] for g in opt.param_groups]
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        run.step = step
        got = hub.metrics(run, step, {})
        if step == 1:
            assert got == {}  # not a log step: nothing copied, nothing reported
            continue
        for (name, want_group), old in zip([("matrix", 0), ("norm_and_bias", 1)], before):
            new = [p.detach() for p in opt.param_groups[want_group]["params"]]
            change = torch.sqrt(sum(((n - o) ** 2).sum() for n, o in zip(new, old)))
            norm = torch.sqrt(sum((o**2).sum() for o in old))
            assert got[f"update_ratio/{name}"] == pytest.approx(float(change / norm), rel=1e-5)
            assert got[f"update_ratio/{name}"] > 0
    hub.emit("plait_train_end", run=run, reason="completed")
    opt.step()  # the pre-hook is gone with the run
    assert hub.metrics(run, 4, {}) == {}


def test_mfu_arithmetic_and_no_guess_on_cpu(monkeypatch):
    class Spec:
        def flops_per_token(self, seq_len):
            return 1000.0 * seq_len

    monitor = mfu_mod.MFU(NoOptions())
    run = make_run(spec=Spec())
    assert monitor.plait_metrics(run, {"seq_len": 8, "tokens_per_s_per_device": 5.0}) == {"mfu": "n/a", "peak_tflops": "n/a"}
    monkeypatch.setattr(mfu_mod, "peak_flops", lambda device: 1e6)
    got = monitor.plait_metrics(run, {"seq_len": 8, "tokens_per_s_per_device": 5.0})
    assert got == {"mfu": pytest.approx(5.0 * 8000.0 / 1e6), "peak_tflops": pytest.approx(1e-6)}
    assert mfu_mod.PEAK_BF16_TFLOPS[[k for k, _ in mfu_mod.PEAK_BF16_TFLOPS].index("H100")][1] == 989.0


def test_memory_adds_no_device_memory_on_cpu():
    assert Memory(NoOptions()).plait_metrics(make_run()) == {}  # no optimizer step counted, no CUDA


def test_memory_counts_parameters_gradients_and_optimizer_state_on_log_steps():
    model = torch.nn.Linear(64, 32)  # 2,080 float32 parameters: 8,320 bytes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = make_run(opt, log_every=2)
    hub = MonitorHub([("memory", Memory(NoOptions()))])
    hub.emit("plait_train_start", run=run)
    for step in (1, 2):
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # as the loop does: no gradient is left when the metrics are read
        run.step = step
        got = hub.metrics(run, step, {})
        if step == 1:
            assert got == {}  # not a log step
            continue
        gib = 2**30
        assert got["mem_params_gib"] == pytest.approx(8320 / gib) and got["mem_grads_gib"] == pytest.approx(8320 / gib)
        assert got["mem_optimizer_gib"] == pytest.approx((2 * 8320 + 2 * 4) / gib)  # exp_avg, exp_avg_sq and a float32 step per parameter
        assert not any(k in got for k in ("mem_allocated_gib", "mem_reserved_gib", "mem_peak_gib"))  # a CPU
    hub.emit("plait_train_end", run=run, reason="completed")
