"""The llama3 model spec: shapes, parameter counts, init, forward, FLOPs, activations."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from core.config.registry import Registry
from core.contract.errors import ConfigError
from core.contract.option_values import build_options
from core.contract.protocols import ModelSpec
from model_specs.llama3 import FLAVORS, Llama3Options, Llama3Spec, plait_register
from model_specs.llama3.model import Transformer, rope_tables


def meta_model(spec: Llama3Spec) -> nn.Module:
    with torch.device("meta"):
        return spec.build()


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def materialized(spec: Llama3Spec, seed: int = 0) -> nn.Module:
    """What the core does: build on meta, to_empty, init_weights."""
    model = meta_model(spec)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        spec.init_weights(model)
    return model


# -- registration and options ----------------------------------------------------


def test_registers_model_component_with_documented_options():
    reg = Registry()
    plait_register(reg)
    comp = reg.get("model", "llama3", "[model]")
    spec = comp.factory(build_options(comp.options, {"flavor": "debug", "dim": 64}, "[model]"))
    assert isinstance(spec, ModelSpec)
    assert spec.args.dim == 64 and spec.args.n_layers == FLAVORS["debug"]["n_layers"]
    assert spec.vocab_size == 512 and spec.max_seq_len == 1024


@pytest.mark.parametrize(
    "table, message",
    [
        ({"flavor": "70b"}, "debug, 50m, 1b, 8b"),
        ({"dim": 130}, "not divisible by n_heads"),
        ({"n_kv_heads": 3}, "not divisible by n_kv_heads"),
        ({"tie_embeddings": "yes"}, "tie_embeddings"),
    ],
)
def test_bad_options_are_config_errors(table, message):
    with pytest.raises(ConfigError, match=message):
        build_options(Llama3Options, table, "[model]")


def test_overrides_replace_only_what_is_set():
    spec = Llama3Spec.from_flavor("1b", n_layers=2, tie_embeddings="false", rope_theta=1e4)
    a = spec.args
    assert (a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.ffn_dim) == (2, 2048, 32, 8, 8192)
    assert a.tie_embeddings is False and a.rope_theta == 1e4
    assert Llama3Spec.from_flavor("debug", tie_embeddings="true").args.tie_embeddings is True


def test_tie_embeddings_takes_tomls_true_and_false():
    """``tie_embeddings = true`` in TOML (or ``--model.tie_embeddings=true``) and ``false`` are taken as booleans."""
    for written, tied in ((True, True), (False, False), ("true", True), ("false", False), ("flavor", True)):
        options = build_options(Llama3Options, {"flavor": "1b", "tie_embeddings": written}, "[model]")
        assert Llama3Spec.from_options(options).args.tie_embeddings is tied, written


# -- parameter counts ---------------------------------------------------------------


def test_1b_has_exactly_1_241_581_568_parameters():
    spec = Llama3Spec.from_flavor("1b")
    model = meta_model(spec)
    assert numel(model) == 1_241_581_568
    assert spec.param_counts()[0] == 1_241_581_568


def test_50m_counts_match_model_and_seed_document():
    spec = Llama3Spec.from_flavor("50m")
    total, non_emb = spec.param_counts()
    assert numel(meta_model(spec)) == total == 88_942_080  # the lab's "total ~89M"
    assert non_emb == 50_344_704  # the lab's "~50M non-embedding"


def test_8b_matches_llama3_8b():
    assert Llama3Spec.from_flavor("8b").param_counts()[0] == 8_030_261_248


# The size presets of the 1.46B-on-8xA100 document: (layers, width, its rounded count), and the
# exact counts docs/models.md states.
PRESETS = {
    "tiny": (12, 512, 85e6, 85_340_672),
    "small": (16, 768, 178e6, 177_955_584),
    "medium": (24, 1024, 374e6, 373_605_376),
    "medium-large": (20, 1152, 401e6, 401_275_008),
    "large": (24, 1536, 763e6, 763_307_520),
    "xlarge": (32, 1920, 1.46e9, 1_461_413_760),
}


@pytest.mark.parametrize("flavor", list(PRESETS))
def test_size_presets_have_the_documents_shapes_and_counts(flavor):
    layers, dim, stated, exact = PRESETS[flavor]
    spec = Llama3Spec.from_flavor(flavor)
    a = spec.args
    assert (a.n_layers, a.dim) == (layers, dim)
    assert spec.param_counts()[0] == numel(meta_model(spec)) == exact
    digits = 3 if stated >= 100e6 else 2  # the document's precision: 85M, 178M, ..., 1.46B
    assert float(f"{exact:.{digits}g}") == stated
    assert a.vocab_size == 50_304 and not a.tie_embeddings and a.max_seq_len == 2048


def test_size_presets_are_in_the_docs():
    text = (__import__("pathlib").Path(__file__).parents[3] / "docs" / "models.md").read_text()
    for flavor, (layers, dim, _, exact) in PRESETS.items():
        assert f"| `{flavor}` | {layers} | {dim:,} |" in text and f"{exact:,}" in text


@pytest.mark.parametrize("flavor", list(FLAVORS))
@pytest.mark.parametrize("tie", ["true", "false"])
def test_param_counts_match_built_model(flavor, tie):
    spec = Llama3Spec.from_flavor(flavor, tie_embeddings=tie)
    model = meta_model(spec)
    total, non_emb = spec.param_counts()
    assert numel(model) == total
    head = {id(model.tok_embeddings.weight), id(model.output.weight)}
    assert sum(p.numel() for p in model.parameters() if id(p) not in head) == non_emb
    assert total - non_emb == spec.args.vocab_size * spec.args.dim * (1 if tie == "true" else 2)


def test_tied_weights_share_storage_after_materialization():
    spec = Llama3Spec.from_flavor("1b")
    model = meta_model(spec)
    assert model.output.weight is model.tok_embeddings.weight
    small = materialized(Llama3Spec.from_flavor("debug", tie_embeddings="true"))
    assert small.output.weight is small.tok_embeddings.weight
    assert small.output.weight.data_ptr() == small.tok_embeddings.weight.data_ptr()
    assert numel(small) == Llama3Spec.from_flavor("debug", tie_embeddings="true").param_counts()[0]
    assert not torch.equal(small.output.weight, torch.zeros_like(small.output.weight))
    untied = meta_model(Llama3Spec.from_flavor("8b"))
    assert untied.output.weight is not untied.tok_embeddings.weight


def test_parameter_names_follow_torchtitan():
    names = set(dict(meta_model(Llama3Spec.from_flavor("debug")).named_parameters()))
    for n in (
        "tok_embeddings.weight",
        "norm.weight",
        "output.weight",
        "layers.1.attention_norm.weight",
        "layers.1.ffn_norm.weight",
        *(f"layers.0.attention.w{x}.weight" for x in "qkvo"),
        *(f"layers.0.feed_forward.w{i}.weight" for i in (1, 2, 3)),
    ):
        assert n in names
    assert not any("bias" in n for n in names)


# -- FLOPs and activations ------------------------------------------------------------


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_flops_per_token_formula(flavor):
    spec = Llama3Spec.from_flavor(flavor)
    a = spec.args
    for seq in (128, 2048):
        assert spec.flops_per_token(seq) == 6 * (spec.param_counts()[1] + a.vocab_size * a.dim) + 12 * a.n_layers * a.dim * seq
    # 1b at 2048 (docs/metrics.md): 6 * (973,146,112 + 131,072 * 2048) + 12 * 16 * 2048 * 2048
    if flavor == "1b":
        assert spec.flops_per_token(2048) == 8_254_795_776


@pytest.mark.parametrize("qk_norm", [False, True])
def test_activation_estimate_matches_saved_tensors(qk_norm):
    spec = Llama3Spec.from_flavor("debug", qk_norm=qk_norm)
    model = materialized(spec)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            saved[s.data_ptr()] = s.nbytes()
        return t

    x = torch.randint(0, spec.vocab_size, (2, 256))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    estimate = spec.activation_bytes(2, 256, 4)
    assert abs(estimate - sum(saved.values())) / sum(saved.values()) < 0.05
    assert spec.activation_bytes(4, 256, 2) > spec.activation_bytes(2, 256, 2)


# -- init --------------------------------------------------------------------------------


def test_meta_init_gives_expected_stds_and_rope_buffers():
    spec = Llama3Spec.from_flavor("debug", n_layers=4, dim=256, ffn_dim=512)
    model = materialized(spec)
    a = spec.args
    for p in model.parameters():
        assert torch.isfinite(p).all()
    resid = a.dim**-0.5 / math.sqrt(2 * a.n_layers)
    wo = torch.cat([l.attention.wo.weight.flatten() for l in model.layers])
    w2 = torch.cat([l.feed_forward.w2.weight.flatten() for l in model.layers])
    wq = torch.cat([l.attention.wq.weight.flatten() for l in model.layers])
    w1 = torch.cat([l.feed_forward.w1.weight.flatten() for l in model.layers])
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.2)
    assert wo.std().item() == pytest.approx(resid, rel=0.2)
    assert w2.std().item() == pytest.approx(resid, rel=0.2)
    assert wq.std().item() == pytest.approx(a.dim**-0.5, rel=0.2)
    assert w1.std().item() == pytest.approx(a.dim**-0.5, rel=0.2)
    assert model.output.weight.std().item() == pytest.approx(a.dim**-0.5, rel=0.2)
    assert torch.equal(model.norm.weight, torch.ones(a.dim))
    assert all(torch.equal(l.ffn_norm.weight, torch.ones(a.dim)) for l in model.layers)

    fresh = spec.build()  # RoPE tables computed eagerly on CPU
    assert model.rope_cos.dtype == torch.float32 and model.rope_cos.shape == (a.max_seq_len, a.head_dim)
    torch.testing.assert_close(model.rope_cos, fresh.rope_cos, rtol=0, atol=0)
    torch.testing.assert_close(model.rope_sin, fresh.rope_sin, rtol=0, atol=0)
    assert "rope_cos" not in model.state_dict()
    # position 1, frequency 0 rotates by exactly one radian
    assert model.rope_cos[1, 0].item() == pytest.approx(math.cos(1.0))


def test_rope_tables_recomputed_in_fp32_after_dtype_cast():
    spec = Llama3Spec.from_flavor("debug")
    model = spec.build().to(torch.bfloat16)
    spec.init_weights(model)
    cos, _ = rope_tables(spec.args.head_dim, spec.args.max_seq_len, spec.args.rope_theta)
    assert model.rope_cos.dtype == torch.float32 and torch.equal(model.rope_cos, cos)


def test_blocks_unwraps_wrappers():
    spec = Llama3Spec.from_flavor("debug")
    model = meta_model(spec)

    class Wrapper(nn.Module):  # like DDP
        def __init__(self, module):
            super().__init__()
            self.module = module

    blocks = spec.blocks(Wrapper(model))
    assert len(blocks) == 2 and blocks[0] is model.layers[0]
    with pytest.raises(TypeError):
        spec.blocks(nn.Linear(2, 2))


# -- forward and training ----------------------------------------------------------------


def test_forward_shapes_and_initial_loss():
    spec = Llama3Spec.from_flavor("debug")
    model = materialized(spec)
    x = torch.randint(0, spec.vocab_size, (3, 64))
    logits = model(x)
    assert logits.shape == (3, 64, spec.vocab_size)
    loss = model(x, x)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    # Logits of std s cost ln V + s^2 / 2 nats on average. The untied head
    # (std dim^-0.5) on unit-RMS features gives s ~ 1; the tied one s ~ 0.02 sqrt(dim).
    assert loss.item() == pytest.approx(math.log(spec.vocab_size) + 0.5, abs=0.25)
    tied = Llama3Spec.from_flavor("debug", tie_embeddings="true")
    assert abs(materialized(tied)(x, x).item() - math.log(spec.vocab_size)) < 0.1
    # ignore_index: only the unmasked positions count
    labels = x.clone()
    labels[:, 32:] = -100
    ref = nn.functional.cross_entropy(logits[:, :32].reshape(-1, spec.vocab_size), x[:, :32].reshape(-1))
    torch.testing.assert_close(model(x, labels), ref)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, spec.max_seq_len + 1, dtype=torch.long))


def test_attention_is_causal():
    spec = Llama3Spec.from_flavor("debug")
    model = materialized(spec)
    x = torch.randint(0, spec.vocab_size, (1, 32))
    y = x.clone()
    y[0, 20:] = (y[0, 20:] + 1) % spec.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_matches_hugging_face_llama():
    transformers = pytest.importorskip("transformers")
    spec = Llama3Spec.from_flavor("debug", dim=64, max_seq_len=64)
    model = materialized(spec)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec.hf_config())).eval()
    rename = {
        "tok_embeddings": "embed_tokens",
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w3": "mlp.up_proj",
        "feed_forward.w2": "mlp.down_proj",
    }
    state = {}
    for name, value in model.state_dict().items():
        for ours, theirs in rename.items():
            name = name.replace(ours, theirs)
        state["lm_head.weight" if name == "output.weight" else "model." + name] = value
    hf.load_state_dict(state, strict=True)
    x = torch.randint(0, spec.vocab_size, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-4, atol=1e-4)


# -- qk_norm -------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", ["debug", "1b", "medium-large"])
def test_qk_norm_adds_two_head_dim_weights_per_layer_counted_and_built(flavor):
    plain, normed = Llama3Spec.from_flavor(flavor), Llama3Spec.from_flavor(flavor, qk_norm=True)
    a = normed.args
    assert normed.param_counts()[1] - plain.param_counts()[1] == a.n_layers * 2 * a.head_dim
    model = meta_model(normed)
    assert numel(model) == normed.param_counts()[0]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["layers.0.attention.q_norm.weight"] == shapes["layers.0.attention.k_norm.weight"] == (a.head_dim,)
    assert not any("q_norm" in n for n, _ in meta_model(plain).named_parameters())


def test_qk_norm_is_initialized_to_one_and_normalizes_each_head_before_rope():
    spec = Llama3Spec.from_flavor("debug", qk_norm=True)
    model = materialized(spec)
    attn = model.layers[0].attention
    assert torch.equal(attn.q_norm.weight, torch.ones(spec.args.head_dim)) and torch.equal(attn.k_norm.weight, torch.ones(spec.args.head_dim))
    seen = {}
    attn.q_norm.register_forward_hook(lambda m, i, o: seen.update(q=o))
    x = torch.randint(0, spec.vocab_size, (2, 16))
    with torch.no_grad():
        model(x)
    rms = seen["q"].pow(2).mean(-1).sqrt()  # [B, T, heads]: each head's query has RMS 1 (weight 1)
    assert seen["q"].shape[-2:] == (spec.args.n_heads, spec.args.head_dim)
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-3, atol=1e-3)
    plain = materialized(Llama3Spec.from_flavor("debug"))
    with torch.no_grad():
        assert not torch.allclose(model(x), plain(x))  # the same weights otherwise: the norms change the function


def test_qk_norm_is_an_architecture_option():
    assert "qk_norm" in Llama3Spec.architecture_options
    assert Llama3Spec.from_flavor("debug", qk_norm=True).resolved_architecture()["qk_norm"] is True


def test_qk_norm_exports_as_qwen3_with_the_same_logits():
    """Hugging Face's Llama has no q/k norm; Qwen3 is Llama's layout with one (per head, before RoPE):
    the export names it, and transformers' Qwen3ForCausalLM computes plait's logits."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only dependency (extra 'dev')")
    spec = Llama3Spec.from_flavor("debug", dim=64, max_seq_len=64, qk_norm=True)
    model = materialized(spec)
    with torch.no_grad():  # norms away from 1, so a norm left out or misplaced shows
        for layer in model.layers:
            layer.attention.q_norm.weight.uniform_(0.5, 1.5)
            layer.attention.k_norm.weight.uniform_(0.5, 1.5)
    config = spec.hf_config()
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config)).eval()
    sd = spec.to_hf_state_dict(model.state_dict())
    assert "model.layers.0.self_attn.q_norm.weight" in sd and "model.layers.1.self_attn.k_norm.weight" in sd
    hf.load_state_dict(sd, strict=True)
    x = torch.randint(0, spec.vocab_size, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-4, atol=1e-4)
    back = spec.from_hf_state_dict({k: v for k, v in hf.state_dict().items()})
    assert set(back) == set(model.state_dict()) and all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    assert Llama3Spec.from_flavor("debug").hf_config()["architectures"] == ["LlamaForCausalLM"]


def test_overfits_one_batch():
    torch.manual_seed(0)
    spec = Llama3Spec.from_flavor("debug", dim=64, ffn_dim=192)
    model = materialized(spec)
    x = torch.randint(0, 257, (4, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = model(x[:, :-1], x[:, 1:])
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_is_a_transformer_built_on_default_device():
    spec = Llama3Spec.from_flavor("debug")
    with torch.device("meta"):
        model = spec.build()
    assert isinstance(model, Transformer)
    assert all(p.is_meta for p in model.parameters()) and model.rope_cos.is_meta


def test_chunked_loss_equals_full_loss_and_grads():
    import torch

    from model_specs.llama3.spec import Llama3Spec

    torch.manual_seed(0)
    full_spec = Llama3Spec.from_flavor("debug", dim=64)
    chunk_spec = Llama3Spec.from_flavor("debug", dim=64, loss_chunk_tokens=100)
    full, chunked = full_spec.build(), chunk_spec.build()
    full_spec.init_weights(full)
    chunked.load_state_dict(full.state_dict())
    ids = torch.randint(0, 257, (3, 128))
    a, b = full(ids, ids), chunked(ids, ids)
    assert torch.allclose(a, b, atol=1e-5)
    a.backward()
    b.backward()
    for (n, p), (_, q) in zip(full.named_parameters(), chunked.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n


def test_flash_attn_request_falls_back_to_sdpa_with_reason(capsys, monkeypatch):
    import importlib.util

    from core.contract import log
    from model_specs.llama3.spec import Llama3Spec

    monkeypatch.setattr(log, "_warned", set())  # the warning is once per process; another test may have had it

    spec = Llama3Spec.from_flavor("debug", attention="flash_attn")
    if importlib.util.find_spec("flash_attn") is None:
        assert spec.args.attention == "sdpa"
        assert "flash-attn is not importable" in capsys.readouterr().err
    else:
        assert spec.args.attention == "flash_attn"


def test_sdpa_backend_is_named():
    """The choice SDPA makes is reported by torch's own choice function (flash on CPU for fp32;
    on CUDA the trainer logs it at the first step)."""
    from model_specs.llama3.model import sdpa_backend

    assert sdpa_backend(4, 64, 128, torch.float32, torch.device("cpu")) in ("flash", "math")
    if torch.cuda.is_available():
        assert sdpa_backend(32, 64, 2048, torch.bfloat16, torch.device("cuda")) in ("flash", "cuDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_takes_full_or_preshaped_tables(dtype):
    """The forward shapes the RoPE tables once ([1, T, 1, hd]); blocks called on their own pass the full
    tables: the same rotation either way, and the fp32 fast path equals the general one."""
    from model_specs.llama3.model import apply_rope

    cos, sin = rope_tables(16, 64, 10_000.0)
    x = torch.randn(2, 40, 3, 16).to(dtype)
    full = apply_rope(x, cos, sin)
    shaped = apply_rope(x, cos[None, :40, None, :], sin[None, :40, None, :])
    assert full.dtype == dtype and torch.equal(full, shaped)
    x1, x2 = x.float().chunk(2, dim=-1)
    reference = (x.float() * cos[None, :40, None] + torch.cat([-x2, x1], -1) * sin[None, :40, None]).to(dtype)
    torch.testing.assert_close(full, reference, rtol=0, atol=0)
