"""Names between plait's llama3 (torchtitan's names) and Hugging Face's LlamaForCausalLM (with
``qk_norm``, Qwen3ForCausalLM: the same names and ``self_attn.q_norm`` / ``k_norm``).

The model uses HF's rotate-half RoPE layout, so weights map one-to-one by
name, without permuting ``wq`` / ``wk``.
"""

from __future__ import annotations

import re

import torch

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # qk_norm: Qwen3's names
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def to_hf(sd: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        if name in _TOP:
            if name == "output.weight" and tied:
                continue  # HF ties lm_head to embed_tokens from config.json
            out[_TOP[name]] = t
            continue
        m = _LAYER_RE.match(name)
        if not m or m.group(2) not in _LAYER:
            raise KeyError(f"no Hugging Face name for {name}")
        out[f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"] = t
    return out


def from_hf(sd: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    top = {v: k for k, v in _TOP.items()}
    layer = {v: k for k, v in _LAYER.items()}
    out = {}
    for name, t in sd.items():
        if name in top:
            out[top[name]] = t
            continue
        m = _HF_LAYER_RE.match(name)
        if m and m.group(2) in layer:
            out[f"layers.{m.group(1)}.{layer[m.group(2)]}"] = t
        elif name.endswith("rotary_emb.inv_freq"):
            continue  # derived, not learned
        else:
            raise KeyError(f"unexpected Hugging Face tensor {name}")
    if tied:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out
