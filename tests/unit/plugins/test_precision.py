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
