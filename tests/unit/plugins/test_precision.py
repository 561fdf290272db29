"""Low precision plugins in this process: nothing supported is a clear error, a bad recipe or no eligible
linear is refused, te_fp8 reports itself unsupported without Transformer Engine, fp8 keeps small linears
and any model's output head in bf16, and precision honours what the model spec declares high precision."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import run_here


def test_nothing_supported_is_a_clear_error(tiny_config):
    proc = run_here("core.train", "--config", str(tiny_config()), '--precision.fallback=["te_fp8", "mxfp8"]')
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "nothing in fallback = ['te_fp8', 'mxfp8'] is supported here" in line and "te_fp8:" in line and "mxfp8:" in line


def test_bad_recipe_and_no_eligible_linear(tiny_config):
    proc = run_here("core.train", "--config", str(tiny_config()), "--precision.name=fp8", "--precision.recipe=fastest")
    assert proc.returncode == 2 and "[precision] (precision 'fp8').recipe: expected 'tensorwise' | 'rowwise'" in proc.stderr
    proc = run_here(
        "core.train",
        "--config",
        str(tiny_config()),
        "--precision.name=fp8",
        "--precision.allow_cpu=true",
        "--model.dim=60",
        "--model.n_heads=2",
        "--model.n_kv_heads=1",
        "--model.ffn_dim=90",
        '--precision.skip=["output"]',
    )
    assert proc.returncode == 2 and "no linear layer with dimensions divisible by 16" in proc.stderr


def test_te_fp8_reports_itself_unsupported_without_te():
    import torch

    from plugins.precision.te_fp8 import TEFP8, TEFP8Options

    ok, why = TEFP8(TEFP8Options()).supported(torch.device("cpu"))
    assert not ok
    assert ("not installed" in why) if importlib.util.find_spec("transformer_engine") is None else ("CUDA" in why)


def float8_reference(t, rowwise: bool):
    """``t`` cast to float8 e4m3 and back as the recipe scales it (tensorwise: one fp32 scale; rowwise: one
    per row, rounded down to a power of 2), in float64: the operands an fp8 GEMM multiplies."""
    import torch

    amax = t.abs().amax(dim=-1, keepdim=True) if rowwise else t.abs().amax()
    scale = (torch.finfo(torch.float8_e4m3fn).max / amax.float().clamp(min=1e-12)).float()
    if rowwise:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() / scale.double()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_fp8_on_cpu_runs_torchaos_emulation_with_the_recipes_numerics(recipe):
    """torch's CPU ``_scaled_mm`` is a scalar reference (minutes a step of the debug model): on CPU every
    recipe is converted with torchao's emulation, the path :meth:`FP8.emulated` names. Its forward equals
    float8-cast operands multiplied in float64 within 1e-5 of the output's largest magnitude; tensorwise's
    forward and gradients equal the real ``_scaled_mm`` kernel's within the same 1e-5 (rowwise's CPU kernel
    itself differs from the cast operands' product by 3e-3, so it is no reference)."""
    import copy

    import torch
    from torch import nn

    from plugins.precision.fp8 import FP8, FP8Options

    class Spec:
        vocab_size = 512

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(128, 256, bias=False))
    x = torch.randn(64, 128)
    precision = FP8(FP8Options(recipe=recipe, allow_cpu=True))
    ok, why = precision.supported(torch.device("cpu"))
    assert ok, why
    assert precision.emulated()
    model = precision.convert(copy.deepcopy(base), Spec())
    linear = model[0]
    assert type(linear).__name__ == "Float8Linear" and linear.config.emulate
    assert all(c.emulate for c in (linear.linear_mm_config.output, linear.linear_mm_config.grad_input, linear.linear_mm_config.grad_weight))

    rowwise = recipe != "tensorwise"
    want = float8_reference(x, rowwise) @ float8_reference(base[0].weight.detach(), rowwise).T
    got = model(x).detach().double()
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())

    if recipe == "tensorwise":  # against the real kernel, forward and backward
        kernel = FP8(FP8Options(recipe=recipe, allow_cpu=True))
        kernel.emulated = lambda: False  # type: ignore[method-assign]  # the scalar _scaled_mm path, small enough here
        real = kernel.convert(copy.deepcopy(base), Spec())
        assert not real[0].config.emulate
        results = []
        for m in (model, real):
            xx = x.clone().requires_grad_()
            y = m(xx)
            y.square().sum().backward()
            results.append((y.detach(), xx.grad, m[0].weight.grad))
        for a, b in zip(*results):
            assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())


def test_core_plan_says_an_fp8_run_on_cpu_uses_the_emulation(tiny_config):
    proc = run_here("core.plan", "--config", str(tiny_config()), "--precision.name=fp8", "--precision.allow_cpu=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "plait: fp8 tensorwise on cpu: torchao's emulated float8 matmuls" in proc.stderr, proc.stderr[-2000:]


def test_fp8_small_gemm_filter_keeps_small_linears_in_bf16():
    """torchao's size thresholds: on the 1b shape the key/value projections (2048 -> 512) and the
    output head stay bf16 under tensorwise; rowwise keeps only the big FFN input GEMMs."""
    import torch

    from model_specs.llama3.spec import Llama3Spec
    from plugins.precision.capability import linear_filter
    from plugins.precision.fp8 import with_size_filter

    with torch.device("meta"):
        model = Llama3Spec.from_flavor("1b").build()

    def kinds(recipe):
        accept = with_size_filter(linear_filter(["output"]), recipe)
        return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if accept(m, n)})

    assert kinds("tensorwise") == ["w1", "w2", "w3", "wo", "wq"]
    assert kinds("rowwise") == ["w1", "w3"]


def test_fp8_leaves_any_models_output_head_in_bf16():
    """The head is found by what it does (maps to the vocabulary), not by llama3's name for it."""
    import torch
    from torch import nn

    from plugins.precision.fp8 import FP8, FP8Options

    class Spec:
        vocab_size = 512

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(64, 64)
            self.lm_head = nn.Linear(64, 512, bias=False)

    precision = FP8(FP8Options(allow_cpu=True))
    ok, why = precision.supported(torch.device("cpu"))
    if not ok:
        pytest.skip(f"fp8 unavailable: {why}")
    model = precision.convert(GPT(), Spec())
    assert type(model.lm_head) is nn.Linear and type(model.body).__name__ == "Float8Linear"
    kept = FP8(FP8Options(allow_cpu=True, skip_head=False)).convert(GPT(), Spec())
    assert type(kept.lm_head).__name__ == "Float8Linear"


@pytest.mark.parametrize("plugin", ["fp8", "mxfp8"])
def test_precision_honours_what_the_model_spec_declares_high_precision(plugin):
    """A spec's ``high_precision_modules(model)`` is what stays out of low precision: here a
    router that maps to nothing like the vocabulary, and not the head the default would keep."""
    import torch
    from torch import nn

    if plugin == "fp8":
        from plugins.precision.fp8 import FP8 as Plugin
        from plugins.precision.fp8 import FP8Options as Options
    else:
        from plugins.precision.mxfp8 import MXFP8 as Plugin
        from plugins.precision.mxfp8 import MXFP8Options as Options

    class Spec:
        vocab_size = 512

        def high_precision_modules(self, model):
            return ["router"]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(64, 64)
            self.router = nn.Linear(64, 64)
            self.lm_head = nn.Linear(64, 512, bias=False)

    precision = Plugin(Options(allow_cpu=True) if plugin == "fp8" else Options(emulate=True))
    ok, why = precision.supported(torch.device("cpu"))
    if not ok:
        pytest.skip(f"{plugin} unavailable on this machine: {why}")
    model = precision.convert(Model(), Spec())

    def low(m):  # fp8 swaps the module, mxfp8 the weight's tensor type
        return type(m) is not nn.Linear or type(m.weight) is not nn.Parameter

    assert not low(model.router)  # declared: kept
    assert low(model.body) and low(model.lm_head)  # the rest converted, the head included


def test_mxfp8_picks_its_kernels_by_the_runs_device_not_the_meta_model(monkeypatch):
    """The model is converted on the meta device; the kernel choice follows the device ``supported()``
    was asked about: an sm100 device (its capability query stubbed: no such GPU here) gets the real
    kernels, a CPU run the emulated one."""
    import torch
    from torch import nn

    import plugins.precision.mxfp8 as mxfp8

    sm100 = torch.device("cuda", 0)
    monkeypatch.setattr(mxfp8, "cuda_capability", lambda device: (10, 0) if device == sm100 else None)

    class Spec:
        vocab_size = 512

    def kernel_on(device):
        precision = mxfp8.MXFP8(mxfp8.MXFP8Options(emulate=True))
        ok, why = precision.supported(device)
        if not ok:
            pytest.skip(f"mxfp8 unavailable on this machine: {why}")
        with torch.device("meta"):  # built there, as core.loop.assemble does
            model = nn.Sequential(nn.Linear(64, 64))
        return precision.convert(model, Spec())[0].weight.config.kernel_preference.value

    assert kernel_on(sm100) != "emulated"
    assert kernel_on(torch.device("cpu")) == "emulated"
