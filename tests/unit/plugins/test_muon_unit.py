"""The ``muon`` optimizer: torch.optim.Muon's arithmetic on the hidden matrices and AdamW's on the rest,
the output head found by the core, bad options refused before any process group, and (slow) the
same updates under ddp, fsdp2 and HSDP, exact resumes, resumes across world sizes and optimizers."""

from __future__ import annotations

import pytest
import torch


def debug_llama(**kw):
    from model_specs.llama3.spec import Llama3Spec

    torch.manual_seed(0)
    spec = Llama3Spec.from_flavor("debug", dim=64, n_layers=2, **kw)
    model = spec.build()
    spec.init_weights(model)
    return spec, model


def muon_groups(spec, model, **options):
    from core.config import registry
    from core.contract.option_values import build_options
    from core.contract.param_groups import param_groups
    from core.contract.protocols import output_head_params

    component = registry.load().get("optimizer", "muon", "test")
    opts = build_options(component.options, options, "[optimizer] muon")
    builder = component.factory(opts)
    assert builder.separate_output_head is True
    return builder, param_groups(model, opts, output_head_params(spec, model))


def test_the_output_head_is_its_own_kind_and_a_hidden_matrix_of_the_vocabularys_width_is_not():
    """ffn_dim = vocab_size: w1 and w3 map to 512 features like the head, but sit inside the blocks."""
    from core.contract.param_groups import param_groups
    from core.contract.protocols import output_head_params

    spec, model = debug_llama(ffn_dim=512)
    assert spec.vocab_size == 512
    builder, groups = muon_groups(spec, model)
    by_name = {g["name"]: g for g in groups}
    assert [p for p in by_name["output"]["params"]] == [model.output.weight]
    assert all(p is not model.output.weight for p in by_name["matrix"]["params"])
    assert [g["name"] for g in groups] == ["matrix", "embedding", "norm", "output"]
    opt = builder.build(groups)
    algorithms = {g["name"]: g["algorithm"] for g in opt.param_groups}
    assert algorithms == {"matrix": "muon", "embedding": "adamw", "norm": "adamw", "output": "adamw"}
    # an optimizer without separate_output_head keeps the head a matrix (its groups are unchanged)
    assert "output" not in {g["name"] for g in param_groups(model, builder.options)}
    # a tied head is the embedding
    spec, tied = debug_llama(tie_embeddings="true")
    assert output_head_params(spec, tied) == (tied.output.weight,) and tied.output.weight is tied.tok_embeddings.weight
    assert "output" not in {g["name"] for g in muon_groups(spec, tied)[1]}


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_updates_equal_torch_muon_on_the_matrices_and_torch_adamw_on_the_rest(adjust_lr):
    spec, model = debug_llama()
    _, reference = debug_llama()
    options = {"lr": 0.02, "weight_decay": 0.05, "adamw_lr": 1e-3, "adamw_weight_decay": 0.1, "adjust_lr": adjust_lr, "lr_multipliers": {"norm": 0.5}}
    options["ns_dtype"] = "bfloat16"  # torch.optim.Muon's (auto: float32 on CPU)
    builder, groups = muon_groups(spec, model, **options)
    ours = builder.build(groups)
    names = {id(p): n for n, p in reference.named_parameters()}
    ref_params = dict(reference.named_parameters())
    theirs = []
    for g in ours.param_groups:
        params = [ref_params[n] for n, p in model.named_parameters() if any(p is q for q in g["params"])]
        if g["algorithm"] == "muon":
            theirs.append(torch.optim.Muon(params, lr=g["lr"], weight_decay=g["weight_decay"], adjust_lr_fn=adjust_lr))
        else:
            theirs.append(torch.optim.AdamW(params, lr=g["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=g["weight_decay"], foreach=False))
    assert len(names) == sum(len(g["params"]) for g in ours.param_groups)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ours.step()
        for opt in theirs:
            opt.step()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), n
    assert {g["name"]: g["lr"] for g in ours.param_groups}["norm"] == 0.5e-3  # adamw_lr x its multiplier
    assert set(ours.state[model.layers[0].attention.wq.weight]) == {"momentum_buffer"}
    assert set(ours.state[model.tok_embeddings.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_auto_iterates_in_float32_on_cpu():
    from plugins.optim.muon import NS_COEFFICIENTS, newton_schulz

    g = torch.randn(96, 32, generator=torch.Generator().manual_seed(0))
    auto, fp32, bf16 = (newton_schulz(g, NS_COEFFICIENTS, 5, 1e-7, d) for d in ("auto", "float32", "bfloat16"))
    assert torch.equal(auto, fp32) and not torch.equal(auto, bf16) and auto.dtype == torch.float32
    singular = torch.linalg.svdvals(auto)
    assert 0.6 < singular.min() and singular.max() < 1.3  # near-orthogonal (Keller Jordan's quintic: roughly 0.7-1.2)
