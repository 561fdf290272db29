"""FP8 forward/backward amax and scales on log steps: torchao float8 linears trained on CPU (real
torch._scaled_mm), tensorwise and rowwise; the mxfp8 emulated kernel; TE's delayed-scaling state read."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from plugins.precision.fp8 import FP8, FP8Options

E4M3, E5M2 = 448.0, 57344.0


def step(plugin, model, x, grad_scale: float, log: bool = True):
    """One training step of ``model`` on ``x`` whose output gradient is exactly ``grad_scale`` everywhere."""
    plugin.log_step(log)
    with plugin.autocast(torch.device("cpu")):
        out = model(x)
    (out.float().sum() * grad_scale).backward()
    model.zero_grad(set_to_none=True)
    return plugin.metrics(model)


def inputs(scale: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (4, 16, 32), generator=g).float() / 4 * scale  # exact in bf16


@pytest.mark.parametrize("recipe, bwd_max, power_of_2", [("tensorwise", E5M2, False), ("rowwise", E4M3, True)])
def test_fp8_forward_and_backward_scales(recipe, bwd_max, power_of_2):
    plugin = FP8(FP8Options(recipe=recipe, allow_cpu=True))
    torch.manual_seed(0)
    model = plugin.convert(nn.Sequential(nn.Linear(32, 64, bias=False)), None)
    expect = (lambda fmax, amax: 2.0 ** math.floor(math.log2(fmax / amax))) if power_of_2 else (lambda fmax, amax: fmax / amax)
    seen = []
    for scale, grad in ((1.0, 0.125), (16.0, 2.0)):
        m = step(plugin, model, inputs(scale), grad)
        amax = float(inputs(scale).abs().max())
        assert m["fp8/fwd_amax"] == amax and m["fp8/bwd_amax"] == grad
        assert m["fp8/fwd_scale"] == pytest.approx(expect(E4M3, amax), rel=1e-6)
        assert m["fp8/bwd_scale"] == pytest.approx(expect(bwd_max, grad), rel=1e-6)
        assert all(math.isfinite(v) for v in m.values()) and "fp8/weight_amax_max" in m
        seen.append(m)
    assert seen[1]["fp8/fwd_scale"] < seen[0]["fp8/fwd_scale"] / 8 and seen[1]["fp8/bwd_scale"] < seen[0]["fp8/bwd_scale"] / 8


def test_fp8_amax_is_the_max_over_micro_batches_and_linears_and_off_steps_do_nothing():
    plugin = FP8(FP8Options(recipe="tensorwise", allow_cpu=True))
    torch.manual_seed(0)
    model = plugin.convert(nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False)), None)
    plugin.log_step(True)
    hidden = []
    for scale in (1.0, 3.0, 0.5):  # three micro-batches of one step
        x = inputs(scale, seed=int(scale * 10))
        with plugin.autocast(torch.device("cpu")):
            h = torch.relu(model[0](x))
            hidden.append(max(float(x.abs().max()), float(h.detach().abs().max())))
            model[2](h).float().pow(2).mean().backward()
    m = plugin.metrics(model)
    assert m["fp8/fwd_amax"] == pytest.approx(max(hidden), rel=1e-6) and m["fp8/bwd_amax"] > 0
    # a step that is not a log step: no hooks on the linears, nothing recorded, only the weight health
    m = step(plugin, model, inputs(100.0), 1.0, log=False)
    assert all(not lin._forward_pre_hooks and not lin._forward_hooks for lin in (model[0], model[2]))
    assert "fp8/fwd_amax" not in m and "fp8/weight_amax_max" in m


def test_mxfp8_records_amax():
    from plugins.precision.mxfp8 import MXFP8, MXFP8Options

    plugin = MXFP8(MXFP8Options(emulate=True))
    torch.manual_seed(0)
    model = plugin.convert(nn.Sequential(nn.Linear(32, 64, bias=False)), None)
    got = []
    for scale in (1.0, 16.0):
        m = step(plugin, model, inputs(scale), 0.25 * scale)
        assert m["mxfp8/fwd_amax"] == float(inputs(scale).abs().max()) and m["mxfp8/bwd_amax"] == 0.25 * scale
        assert "mxfp8/weight_amax_max" in m and "mxfp8/fwd_scale" not in m
        got.append(m)
    assert got[1]["mxfp8/fwd_amax"] == 16 * got[0]["mxfp8/fwd_amax"]


def test_te_scales_read_from_the_delayed_scaling_state():
    """Transformer Engine is not installable here: its documented fp8_meta layout, built by hand."""
    from plugins.precision.te_fp8 import te_scale_stats

    def meta(fwd_scale, fwd_amax, bwd_scale, bwd_amax):
        hist = lambda latest: torch.tensor([latest, [1e6] * len(latest)])  # noqa: E731  (row 0: the latest step)
        return {
            "scaling_fwd": SimpleNamespace(scale=torch.tensor(fwd_scale), amax_history=hist(fwd_amax)),
            "scaling_bwd": SimpleNamespace(scale=torch.tensor(bwd_scale), amax_history=hist(bwd_amax)),
        }

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU())
    model[0].fp8_meta = meta([100.0, 50.0, 1.0], [4.0, 8.0, 0.0], [1000.0, 1.0], [50.0, 0.0])
    model[1].fp8_meta = meta([20.0, 60.0, 1.0], [20.0, 7.0, 0.0], [3000.0, 1.0], [18.0, 0.0])
    assert te_scale_stats(model) == {"fp8/fwd_scale": 1.0, "fp8/fwd_amax": 20.0, "fp8/bwd_scale": 1.0, "fp8/bwd_amax": 50.0}
    assert te_scale_stats(nn.Linear(2, 2)) == {}
