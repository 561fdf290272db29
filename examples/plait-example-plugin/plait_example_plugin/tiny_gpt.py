"""``tiny_gpt``: a GPT-2 style model spec with tied input and output embeddings.

Learned positions, pre-norm blocks with LayerNorm, a GELU MLP, and the output
head sharing the token embedding (``lm_head.weight = wte.weight`` in
``build()``, the standard tie). plait keeps the tie through its meta-device
build, so the run trains exactly the parameters this module declares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.api import option


@dataclass
class TinyGPTOptions:
    vocab_size: int = option(512, "vocabulary size, > every token id of the data")
    dim: int = option(64, "model width")
    n_layers: int = option(2, "transformer blocks")
    n_heads: int = option(4, "attention heads, divide dim")
    max_seq_len: int = option(256, "longest sequence (learned positions)")

    def check(self) -> None:
        if min(self.vocab_size, self.dim, self.n_layers, self.n_heads, self.max_seq_len) <= 0:
            raise ValueError("vocab_size, dim, n_layers, n_heads and max_seq_len must be > 0")
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads {self.n_heads} must divide dim {self.dim}")


class Block(nn.Module):
    def __init__(self, o: TinyGPTOptions):
        super().__init__()
        self.n_heads = o.n_heads
        self.ln1, self.ln2 = nn.LayerNorm(o.dim), nn.LayerNorm(o.dim)
        self.qkv = nn.Linear(o.dim, 3 * o.dim)
        self.proj = nn.Linear(o.dim, o.dim)
        self.fc, self.out = nn.Linear(o.dim, 4 * o.dim), nn.Linear(4 * o.dim, o.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, o: TinyGPTOptions):
        super().__init__()
        self.wte = nn.Embedding(o.vocab_size, o.dim)
        self.wpe = nn.Embedding(o.max_seq_len, o.dim)
        self.blocks = nn.ModuleList(Block(o) for _ in range(o.n_layers))
        self.ln_f = nn.LayerNorm(o.dim)
        self.lm_head = nn.Linear(o.dim, o.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


class TinyGPT:
    """The model spec: what plait asks of a model plugin (core.contract.protocols.ModelSpec)."""

    def __init__(self, options: TinyGPTOptions) -> None:
        self.o = options
        self.vocab_size = options.vocab_size

    def build(self) -> nn.Module:
        return GPT(self.o)

    def init_weights(self, model: nn.Module) -> None:
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)

    def flops_per_token(self, seq_len: int) -> float:
        o = self.o
        params = 12 * o.n_layers * o.dim**2 + o.vocab_size * o.dim  # the tied head's matmul is work
        return 6 * params + 12 * o.n_layers * o.dim * seq_len

    def activation_bytes(self, micro_batch: int, seq_len: int, bytes_per_element: int) -> int:
        o = self.o
        return micro_batch * seq_len * (o.n_layers * 34 * o.dim + 2 * o.vocab_size) * bytes_per_element
