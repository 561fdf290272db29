"""Optimizer plugins and schedules in this process: parameter groups and their LR multipliers, the wsd and
linear schedules' values, and AdamW's ``impl = "auto"`` kernel choice."""

from __future__ import annotations

import math

import pytest


def test_param_groups_and_multipliers():
    from core.contract.param_groups import OptimizerOptions, param_groups
    from model_specs.llama3.spec import Llama3Spec

    spec = Llama3Spec.from_flavor("debug", dim=64, tie_embeddings="true")
    model = spec.build()
    groups = {g["name"]: g for g in param_groups(model, OptimizerOptions(lr=1.0, lr_multipliers={"embedding": 0.5}))}
    assert groups["embedding"]["weight_decay"] == 0 and groups["embedding"]["lr"] == 0.5
    assert groups["norm"]["weight_decay"] == 0 and groups["matrix"]["weight_decay"] == 0.1
    ids = {id(p) for g in groups.values() for p in g["params"]}
    assert len(ids) == sum(len(g["params"]) for g in groups.values())  # the tied weight appears once
    assert model.output.weight is model.tok_embeddings.weight and id(model.tok_embeddings.weight) in ids


def test_wsd_and_linear_values():
    from plugins.schedules.schedules import WSD, Linear, LinearOptions, WSDOptions

    wsd = WSD(WSDOptions(warmup_steps=10, decay_fraction=0.2, decay_shape="linear", min_lr_ratio=0.0))
    assert wsd.multiplier(9, 100) == 1.0 and wsd.multiplier(79, 100) == 1.0
    assert wsd.multiplier(89, 100) == pytest.approx(0.5) and wsd.multiplier(99, 100) == pytest.approx(0.0)
    sq = WSD(WSDOptions(decay_fraction=0.5, decay_shape="1-sqrt", min_lr_ratio=0.1))
    assert sq.multiplier(74, 100) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.5)))
    cos = WSD(WSDOptions(decay_fraction=0.5, decay_shape="cosine"))
    assert cos.multiplier(74, 100) == pytest.approx(0.5)
    lin = Linear(LinearOptions(warmup_steps=10, min_lr_ratio=0.1))
    assert lin.multiplier(0, 110) == pytest.approx(0.1) and lin.multiplier(9, 110) == 1.0
    assert lin.multiplier(59, 110) == pytest.approx(0.55) and lin.multiplier(109, 110) == pytest.approx(0.1)


def test_adamw_auto_picks_the_fused_kernel_where_torch_has_one():
    """``impl = "auto"``: fused on CPU (3.5-5x the foreach kernel there, docs/benchmarks.md) and CUDA;
    foreach where torch has no fused kernel (the meta device of a plan). The fused kernel moves the
    weights as the foreach one does, and skips an update on the device (found_inf)."""
    import torch

    from plugins.optim.adamw import AdamW, AdamWOptions

    def build(impl: str, device: str = "cpu") -> torch.optim.Optimizer:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 32, device=device))
        return AdamW(AdamWOptions(lr=1e-2, impl=impl)).build([{"params": [p], "weight_decay": 0.1}])

    assert build("auto").defaults["fused"] is True
    assert build("auto", "meta").defaults["fused"] is None and build("auto", "meta").defaults["foreach"] is True
    fused, foreach = build("auto"), build("foreach")
    for opt in (fused, foreach):
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            p = opt.param_groups[0]["params"][0]
            p.grad = torch.randn(p.shape, generator=g)
            opt.step()
    a, b = fused.param_groups[0]["params"][0], foreach.param_groups[0]["params"][0]
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6) and not torch.equal(a, build("auto").param_groups[0]["params"][0])
    before = a.detach().clone()
    fused.grad_scale, fused.found_inf = None, torch.ones(())  # what core.loop.nonfinite sets on a non-finite step
    fused.step()
    assert torch.equal(a, before)
