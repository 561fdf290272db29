"""The recurrent MoE's health monitor: a healthy model raises nothing, each signal (collapsed or dead
experts, diverging loops, a skewed router, low router entropy) fires on a constructed failure at its
threshold, warnings of a kind are rate-limited with a count, stop actions are never held back, and
its options are bounded; its FLOPs count the loops."""

from __future__ import annotations

import torch

from core.contract.protocols import DistInfo
from core.contract.run import Run
from model_specs.recurrent_moe.spec import RecurrentMoEOptions, RecurrentMoESpec
from plugins.monitors.recurrent_moe import RecurrentMoEMonitor, RecurrentMoEMonitorOptions


def model(**over):
    spec = RecurrentMoESpec.from_options(RecurrentMoEOptions(**over))
    torch.manual_seed(0)
    m = spec.build()
    spec.init_weights(m)
    return spec, m


def health(m):
    ids = torch.randint(0, 256, (2, 64))
    m(ids, ids)  # a training forward (validation's no_grad forwards are not counted)
    return m.extra_metrics()


def check(metrics, **opts):
    mon = RecurrentMoEMonitor(RecurrentMoEMonitorOptions(**opts))
    run = Run(config={}, output_dir=None, dist=DistInfo(), total_steps=10, tokens_per_step=1)
    mon.plait_step_end(run=run, step=1, metrics=metrics)
    return mon, run


def test_healthy_model_raises_nothing():
    _, m = model()
    mon, run = check(health(m))
    assert list(mon.fired) == [] and run.stop is None


def test_collapsed_experts_fire_and_stop():
    _, m = model()
    with torch.no_grad():
        for block in m.blocks():
            for w in (block.moe.experts.w1, block.moe.experts.w3, block.moe.experts.w2):
                w[1:] = w[0]  # every expert a copy of expert 0
    metrics = health(m)
    assert metrics["moe/expert_spread_min"] < 1e-6
    mon, run = check(metrics)
    assert "collapse" in mon.fired and run.stop is not None and run.stop.checkpoint


def test_diverging_loops_fire():
    _, m = model()
    with torch.no_grad():
        for block in m.core:  # a core block that rewrites the state on every pass
            block.attention.wo.weight.mul_(300.0)
            block.moe.experts.w2.mul_(300.0).neg_()
    metrics = health(m)
    assert metrics["moe/loop_cos_min"] < 0.5
    mon, run = check(metrics, on_drift="stop")
    assert "drift" in mon.fired and run.stop is not None


def test_imbalance_from_a_skewed_router():
    _, m = model()
    with torch.no_grad():
        for block in m.blocks():  # one router direction dominates
            block.moe.router.weight.zero_()
            block.moe.router.weight[0].fill_(5.0)
    metrics = health(m)
    assert metrics["moe/load_imbalance"] > 1.5
    mon, run = check(metrics, imbalance=1.5)
    assert list(mon.fired) == ["imbalance"] and run.stop is None  # warn only


def test_dead_expert_needs_the_whole_window():
    mon = RecurrentMoEMonitor(RecurrentMoEMonitorOptions(dead_window=3))
    run = Run(config={}, output_dir=None, dist=DistInfo(), total_steps=10, tokens_per_step=1)
    for step, tokens in enumerate([[5, 3, 1, 0], [4, 4, 0, 0], [6, 2, 0, 0], [5, 3, 0, 0]], 1):
        mon.plait_step_end(run=run, step=step, metrics={"moe/expert_tokens": tokens})
    # expert 3 is dead from the third interval on; expert 2 only after three empty intervals
    assert run.state["moe_alerts"]["dead"] == 2 and list(mon.fired) == ["dead", "dead"]


def test_flops_count_loops():
    spec3, _ = model(n_loops=3)
    spec6, _ = model(n_loops=6)
    assert spec6.flops_per_token(256) > spec3.flops_per_token(256)


def test_low_router_entropy_fires_at_its_threshold():
    _, m = model()
    with torch.no_grad():
        for block in m.blocks():  # a router so sharp that each token's probabilities are one-hot
            block.moe.router.weight.mul_(1000.0)
    metrics = health(m)
    assert metrics["moe/router_entropy"] < 0.1
    mon, run = check(metrics, imbalance=100.0)
    assert list(mon.fired) == ["entropy"] and run.stop is None
    mon, run = check(metrics, imbalance=100.0, router_entropy=0.0)  # threshold off
    assert list(mon.fired) == []
    mon, run = check(metrics, imbalance=100.0, on_entropy="stop")
    assert run.stop is not None and "router entropy" in run.stop.reason
    healthy = health(model()[1])
    assert healthy["moe/router_entropy"] > 0.5 and list(check(healthy)[0].fired) == []


def test_warnings_of_a_kind_are_rate_limited_with_a_count(capsys):
    mon = RecurrentMoEMonitor(RecurrentMoEMonitorOptions(warn_every=50))
    run = Run(config={}, output_dir=None, dist=DistInfo(), total_steps=1000, tokens_per_step=1)
    drift = {"moe/loop_cos_min": 0.1}
    for step in range(10, 200, 10):  # drift at every log step; imbalance once, at step 30
        mon.plait_step_end(run=run, step=step, metrics={**drift, **({"moe/load_imbalance": 9.0} if step == 30 else {})})
    lines = capsys.readouterr().err.splitlines()
    drifts = [line for line in lines if "drift" in line]
    assert [line.split(":")[2].strip() for line in drifts] == ["step 10", "step 60", "step 110", "step 160"]
    assert drifts[0].endswith("(warn)") and drifts[1].endswith("(warn; 4 more since step 10 not shown)")
    assert drifts[3].endswith("(warn; 4 more since step 110 not shown)")
    assert [line for line in lines if "imbalance" in line][0].endswith("(warn)")  # its own kind, its own clock
    assert run.state["moe_alerts"] == {"drift": 19, "imbalance": 1}  # every occurrence counted
    every = RecurrentMoEMonitor(RecurrentMoEMonitorOptions(warn_every=0))
    for step in (1, 2, 3):
        every.plait_step_end(run=run, step=step, metrics=drift)
    assert len(capsys.readouterr().err.splitlines()) == 3


def test_stop_actions_are_never_held_back():
    mon = RecurrentMoEMonitor(RecurrentMoEMonitorOptions(warn_every=1000, on_drift="stop"))
    for step in (1, 2):
        run = Run(config={}, output_dir=None, dist=DistInfo(), total_steps=10, tokens_per_step=1)
        mon.plait_step_end(run=run, step=step, metrics={"moe/loop_cos_min": 0.1})
        assert run.stop is not None


def test_monitor_options_are_bounded():
    from core.contract.errors import ConfigError
    from core.contract.option_values import build_options

    for key, bad, expected in (
        ("router_entropy", -0.1, "must be >= 0"),
        ("warn_every", -1, "must be >= 0"),
        ("drift_cos", 1.5, "must be >= -1 and <= 1"),
        ("dead_window", 0, "must be >= 1"),
    ):
        try:
            build_options(RecurrentMoEMonitorOptions, {key: bad}, "[monitors.recurrent_moe]")
        except ConfigError as e:
            assert str(e).startswith(f"[monitors.recurrent_moe].{key}: {expected}"), str(e)
        else:
            raise AssertionError(f"{key} = {bad} accepted")


def test_a_signal_at_every_log_step_keeps_the_monitor_bounded():
    """A warning that fires at every log step of a long run (soak): the monitor keeps its latest
    signals only, and the run state one counter per kind."""
    mon = RecurrentMoEMonitor(RecurrentMoEMonitorOptions(warn_every=10**9))
    run = Run(config={}, output_dir=None, dist=DistInfo(), total_steps=10**6, tokens_per_step=1)
    for step in range(1, 5001):
        mon.plait_step_end(run=run, step=step, metrics={"moe/loop_cos_min": 0.1, "moe/load_imbalance": 9.0})
    assert len(mon.fired) <= 100 and list(mon.fired)[-2:] == ["drift", "imbalance"]
    assert run.state["moe_alerts"] == {"drift": 5000, "imbalance": 5000}
    assert len(mon.printed) == 2 and sum(mon.held.values()) == 2 * 4999
