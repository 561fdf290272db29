"""The recurrent MoE model trains, and each health signal fires on a constructed failure."""

from __future__ import annotations

import torch
from conftest import read_metrics, run_module

from core.protocols import DistInfo
from core.run import Run
from model_specs.recurrent_moe.spec import RecurrentMoEOptions, RecurrentMoESpec
from plugins.monitors.recurrent_moe import RecurrentMoEMonitor, RecurrentMoEMonitorOptions


def test_trains_and_logs_each_loss(tmp_path):
    proc = run_module("core.train", "--config", "train_configs/recurrent_moe_debug.toml", f"--train.output_dir={tmp_path}",
                      "--train.steps=20", "--train.log_every=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.8
    for key in ("lm", "aux", "z", "moe/loop_cos_min", "moe/expert_spread_min", "moe/load_imbalance", "moe/router_entropy"):
        assert key in rows[-1], key
    assert len(rows[-1]["moe/expert_tokens"]) == 4 and sum(rows[-1]["moe/expert_tokens"]) > 0
    assert "| lm " in proc.stdout and "| aux " in proc.stdout


def model(**over):
    spec = RecurrentMoESpec.from_options(RecurrentMoEOptions(**over))
    torch.manual_seed(0)
    m = spec.build()
    spec.init_weights(m)
    return spec, m


def health(m):
    ids = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        m(ids, ids)
    return m.extra_metrics()




def check(metrics, **opts):
    mon = RecurrentMoEMonitor(RecurrentMoEMonitorOptions(**opts))
    run = Run(config={}, output_dir=None, dist=DistInfo(), total_steps=10, tokens_per_step=1)
    mon.plait_step_end(run=run, step=1, metrics=metrics)
    return mon, run


def test_healthy_model_raises_nothing():
    _, m = model()
    mon, run = check(health(m))
    assert mon.fired == [] and run.stop is None


def test_collapsed_experts_fire_and_stop():
    _, m = model()
    with torch.no_grad():
        for block in m.blocks():
            for expert in block.moe.experts[1:]:
                expert.load_state_dict(block.moe.experts[0].state_dict())
    metrics = health(m)
    assert metrics["moe/expert_spread_min"] < 1e-6
    mon, run = check(metrics)
    assert "collapse" in mon.fired and run.stop is not None and run.stop.checkpoint


def test_diverging_loops_fire():
    _, m = model()
    with torch.no_grad():
        for block in m.core:  # a core block that rewrites the state on every pass
            block.attention.wo.weight.mul_(300.0)
            for expert in block.moe.experts:
                expert.w2.weight.mul_(300.0).neg_()
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
    assert mon.fired == ["imbalance"] and run.stop is None  # warn only


def test_dead_expert_needs_the_whole_window():
    mon = RecurrentMoEMonitor(RecurrentMoEMonitorOptions(dead_window=3))
    run = Run(config={}, output_dir=None, dist=DistInfo(), total_steps=10, tokens_per_step=1)
    for step, tokens in enumerate([[5, 3, 1, 0], [4, 4, 0, 0], [6, 2, 0, 0], [5, 3, 0, 0]], 1):
        mon.plait_step_end(run=run, step=step, metrics={"moe/expert_tokens": tokens})
    # expert 3 is dead from the third interval on; expert 2 only after three empty intervals
    assert run.state["moe_alerts"]["dead"] == 2 and mon.fired == ["dead", "dead"]


def test_flops_count_loops():
    spec3, _ = model(n_loops=3)
    spec6, _ = model(n_loops=6)
    assert spec6.flops_per_token(256) > spec3.flops_per_token(256)
