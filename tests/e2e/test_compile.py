"""Every compiled block traces as one graph: zero graph breaks under torch.compile (dynamo on CPU),
for the llama3 and recurrent-MoE blocks (sparse dispatch, dropless and with a capacity factor), in fp32, bf16
and fp8 (torchao tensorwise and rowwise); the compiled sparse MoE block computes what the eager one does."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from model_specs.llama3.spec import Llama3Spec
from model_specs.recurrent_moe.spec import RecurrentMoEOptions, RecurrentMoESpec

# one intra-op thread, as in the trainer processes the e2e tests start (OMP_NUM_THREADS=1): inductor's CPU
# kernels specialize on the thread count, so only then can its on-disk cache serve one test's graphs to another
pytestmark = pytest.mark.usefixtures("one_thread")


def model_and_spec(kind: str):
    if kind == "llama3":
        spec = Llama3Spec.from_flavor("debug", dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128)
    else:  # recurrent_moe: sparse dispatch (dropless), or with a capacity factor
        spec = RecurrentMoESpec.from_options(RecurrentMoEOptions(capacity_factor=1.5 if kind.endswith("capacity") else 0.0))
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


@pytest.mark.parametrize("kind", ["llama3", "recurrent_moe", "recurrent_moe-capacity"])
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


def loss_inputs(n=72, d=32, vocab=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = torch.randn(vocab, d, generator=g).mul_(0.2).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100  # ignored positions
    return hidden, weight, labels


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_chunked_cross_entropy_has_no_graph_breaks(precision):
    from core.contract.losses import _checkpointed_chunk, chunked_cross_entropy, output_cross_entropy

    hidden, weight, labels = loss_inputs()
    dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        for fn, args in [
            (_checkpointed_chunk, (hidden[:16], weight, labels[:16])),  # the compiled unit
            (chunked_cross_entropy, (hidden, weight, labels, 16)),
            (output_cross_entropy, (hidden, weight, labels)),
        ]:
            explained = dynamo.explain(fn)(*args)
            assert explained.graph_break_count == 0, [str(r.reason).splitlines()[0] for r in explained.break_reasons]
            assert explained.graph_count >= 1
    dynamo.reset()


@pytest.mark.parametrize("chunk", [16, 0])
def test_compiled_loss_matches_eager(chunk):
    """Loss and gradients of the compiled loss (inductor on CPU) equal eager's within fp32 rounding,
    for chunks that do not divide the tokens (a shorter last chunk) and for the unchunked form."""
    from core.contract.losses import chunked_cross_entropy, output_cross_entropy

    def run(compile):
        hidden, weight, labels = loss_inputs()
        if chunk:
            loss = chunked_cross_entropy(hidden, weight, labels, chunk, compile=compile)
        else:
            loss = output_cross_entropy(hidden, weight, labels, compile=compile)
        loss.backward()
        return loss.detach(), hidden.grad, weight.grad

    dynamo.reset()
    eager, comp = run(False), run(True)
    for a, b in zip(eager, comp):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    dynamo.reset()


def test_train_compile_compiles_the_loss():
    """apply_compile (train.compile) turns the llama3 model's loss into the compiled one, and the
    model's loss and gradients stay those of the eager model. The shapes are those of the tiny config
    that ``tests/e2e/test_parallel.py::test_compile_per_block_trains`` trains (two micro-batch rows of
    128 tokens, dim 64), so inductor's on-disk cache serves whichever of the two compiles second."""
    from core.loop.parallelize import apply_compile

    spec = Llama3Spec.from_flavor("debug", dim=64)
    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(1))
    results = []
    dynamo.reset()
    for compile in (False, True):
        torch.manual_seed(0)
        model = spec.build()
        spec.init_weights(model)
        if compile:
            apply_compile(model, spec)
            assert model.compile_loss
        loss = model(ids, ids)
        loss.backward()
        results.append((loss.detach(), model.output.weight.grad.clone(), model.norm.weight.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    dynamo.reset()


def test_compiled_sparse_moe_block_matches_eager():
    spec, model = model_and_spec("recurrent_moe")
    block = spec.blocks(model)[0]
    cos, sin = model.rope_cos[None, :32, None, :], model.rope_sin[None, :32, None, :]
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    eager = block(x, cos, sin)[0]
    (gx,) = torch.autograd.grad(eager.sum(), x)
    dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager")(x, cos, sin)[0]
    (cx,) = torch.autograd.grad(compiled.sum(), x)
    dynamo.reset()
    assert torch.allclose(compiled, eager, atol=1e-5) and torch.allclose(cx, gx, atol=1e-5)
