"""Every compiled block traces as one graph: zero graph breaks under torch.compile (dynamo on CPU),
for the llama3 and recurrent-MoE blocks, in fp32, bf16 and fp8 (torchao tensorwise and rowwise)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from model_specs.llama3.spec import Llama3Spec
from model_specs.recurrent_moe.spec import RecurrentMoEOptions, RecurrentMoESpec


def model_and_spec(kind: str):
    if kind == "llama3":
        spec = Llama3Spec.from_flavor("debug", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128)
    else:
        spec = RecurrentMoESpec.from_options(RecurrentMoEOptions())
    model = spec.build()
    spec.init_weights(model)
    return spec, model


def convert_fp8(model, recipe: str):
    from plugins.precision.fp8 import FP8, FP8Options

    precision = FP8(FP8Options(recipe=recipe, allow_cpu=True, skip=[]))
    ok, why = precision.supported(torch.device("cpu"))
    if not ok:
        pytest.skip(f"fp8 unavailable here: {why}")
    return precision.convert(model, None)


@pytest.mark.parametrize("kind", ["llama3", "recurrent_moe"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8-tensorwise", "fp8-rowwise"])
def test_blocks_have_no_graph_breaks(kind, precision):
    spec, model = model_and_spec(kind)
    if precision.startswith("fp8"):
        model = convert_fp8(model, precision.split("-")[1])
    x = torch.randn(2, 32, 64)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32")
    dynamo.reset()
    for block in spec.blocks(model):
        with autocast:
            explained = dynamo.explain(block)(x, model.rope_cos, model.rope_sin)
        reasons = [str(r.reason).splitlines()[0] for r in explained.break_reasons]
        assert explained.graph_break_count == 0, reasons
    dynamo.reset()


def test_chunked_cross_entropy_has_no_graph_breaks():
    from core.losses import chunked_cross_entropy

    hidden = torch.randn(64, 32, requires_grad=True)
    weight = torch.randn(100, 32, requires_grad=True)
    labels = torch.randint(0, 100, (64,))
    dynamo.reset()
    explained = dynamo.explain(chunked_cross_entropy)(hidden, weight, labels, 16)
    assert explained.graph_break_count == 0, [str(r.reason).splitlines()[0] for r in explained.break_reasons]
    dynamo.reset()
