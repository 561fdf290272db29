"""The recurrent MoE's sparse dispatch in process: the dense model's function (losses, gradients, health
metrics), a capacity factor that drops what exceeds it, FLOPs of the active experts, bad options named.
Through the trainer on 2 ranks: tests/e2e/test_moe_dispatch_e2e.py."""

from __future__ import annotations

import pytest
import torch

from model_specs.recurrent_moe.experts import capacity
from model_specs.recurrent_moe.model import MoE
from model_specs.recurrent_moe.spec import RecurrentMoEOptions, RecurrentMoESpec


def build(**over):
    spec = RecurrentMoESpec.from_options(RecurrentMoEOptions(**over))
    torch.manual_seed(0)
    model = spec.build()
    spec.init_weights(model)
    return model


def loss_and_grads(model, ids, labels):
    loss = model(ids, labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("over", [{}, {"n_experts": 8, "top_k": 2}, {"top_k": 1}], ids=["debug", "8x2", "top1"])
def test_sparse_dispatch_is_the_dense_model(over):
    dense, sparse = build(dispatch="dense", **over), build(**over)
    sparse.load_state_dict(dense.state_dict())  # the same parameter names: a dense checkpoint loads as it is
    assert [n for n, _ in dense.named_parameters()] == [n for n, _ in sparse.named_parameters()]
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 512, (2, 48), generator=g), torch.randint(0, 512, (2, 48), generator=g)
    loss_d, grads_d = loss_and_grads(dense, ids, labels)
    loss_s, grads_s = loss_and_grads(sparse, ids, labels)
    assert torch.allclose(loss_s, loss_d, rtol=1e-6, atol=1e-6)
    for name, grad in grads_d.items():
        assert torch.allclose(grads_s[name], grad, rtol=1e-4, atol=1e-6), name
    got, want = sparse.extra_metrics(), dense.extra_metrics()
    assert got["moe/expert_tokens"] == want["moe/expert_tokens"] and sum(got["moe/expert_tokens"]) == 3 * 2 * 48 * over.get("top_k", 2)
    for key in ("lm", "aux", "z", "moe/router_entropy", "moe/expert_spread_min", "moe/loop_cos_min", "moe/load_imbalance"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_capacity_factor_drops_the_pairs_past_each_experts_capacity():
    torch.manual_seed(0)
    moe = MoE(16, 32, 4, 2, capacity_factor=1.0)
    with torch.no_grad():  # every token routes to experts 0 and 1
        moe.router.weight.zero_()
        moe.router.weight[0, 0], moe.router.weight[1, 0] = 2.0, 1.0
    x = torch.randn(8, 16)
    x[:, 0] = x[:, 0].abs() + 1
    cap = capacity(16, 4, 1.0)
    assert cap == 4
    y, _, _ = moe(x)
    probs = moe.router(x).softmax(-1)
    w = probs[:, :2] / probs[:, :2].sum(-1, keepdim=True)
    full = moe.experts.one(0, x) * w[:, :1] + moe.experts.one(1, x) * w[:, 1:]
    assert torch.allclose(y[:cap], full[:cap], atol=1e-6)  # first come, first served
    assert torch.allclose(y[cap:], torch.zeros_like(y[cap:]))  # both experts full: nothing for the rest
    roomy = MoE(16, 32, 4, 2, capacity_factor=2.0)  # capacity 8: every pair fits
    roomy.load_state_dict(moe.state_dict())
    assert torch.allclose(roomy(x)[0], full, atol=1e-6)


def test_flops_count_the_active_experts_only():
    def flops(**over):
        return RecurrentMoESpec.from_options(RecurrentMoEOptions(**over)).flops_per_token(256)

    applied, dim = 1 + 1 * 3 + 1, 64
    assert flops(n_experts=8) - flops(n_experts=4) == 6 * applied * dim * 4  # the router's 4 more columns only
    assert flops(dispatch="dense") == flops()  # the model's cost, not the reference path's


def test_bad_moe_options_name_the_key():
    with pytest.raises(ValueError, match=r"top_k 5: expected 1 to n_experts \(4\)"):
        RecurrentMoEOptions(top_k=5).check()
    with pytest.raises(ValueError, match=r"capacity_factor 0.5: expected 0 \(dropless\) or at least 1"):
        RecurrentMoEOptions(capacity_factor=0.5).check()


def test_the_collapse_probe_runs_on_log_steps_only():
    """The trainer tells the model whether the coming step is a log step (``log_step``); the probe that runs
    every expert on 16 tokens runs on those steps' micro-batches only, and no other step reports a spread."""
    model = build()
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(2))
    model.log_step(False)
    model(ids, ids).backward()
    assert all("spread" not in block.moe.stats for block in model.blocks())
    metrics = model.extra_metrics()  # (it starts the next log window)
    assert "moe/expert_spread_min" not in metrics and "moe/router_entropy" in metrics
    model.zero_grad(set_to_none=True)
    model.log_step(True)
    model(ids, ids).backward()
    assert model.extra_metrics()["moe/expert_spread_min"] > 0
