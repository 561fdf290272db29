"""A Llama-3 style decoder in one file: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Parameter names follow torchtitan's llama3 (``tok_embeddings``,
``layers.{i}.attention.wq`` ...), and RoPE uses the "rotate half" layout of
Hugging Face's ``LlamaForCausalLM``, so a checkpoint maps onto HF names
one-to-one without permuting ``wq``/``wk``. :class:`Llama3Options` declares every option once; its
resolved form (the flavor's shapes filled in) is the model's arguments.

The module does not initialize its weights: :class:`model_specs.llama3.spec.Llama3Spec`
builds it on the meta device and calls :meth:`Transformer.init_weights` after
the weights have been given real storage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from core.api import log, option


def resolve_attention(requested: Literal["sdpa", "flash_attn"]) -> Literal["sdpa", "flash_attn"]:
    """``flash_attn`` when the package imports, else ``sdpa`` with the reason logged once."""
    if requested != "flash_attn":
        return requested
    try:
        import flash_attn  # noqa: F401
    except ImportError as e:
        log.warn(f"model.attention = 'flash_attn' but flash-attn is not importable ({e}); using sdpa", once="llama3:flash_attn")
        return "sdpa"
    return "flash_attn"


FLAVORS: dict[str, dict[str, Any]] = {
    # Trains in seconds on a CPU; byte-level data uses ids < 257.
    "debug": dict(
        n_layers=2,
        dim=128,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=384,
        vocab_size=512,
        rope_theta=10_000.0,
        max_seq_len=1024,
        tie_embeddings=False,
    ),
    # Lab 00 of the one-day cloud run: GPT-2 BPE vocab; 50.3M non-embedding and
    # ~89M total parameters, which holds only with tied embeddings.
    "50m": dict(
        n_layers=8,
        dim=768,
        n_heads=12,
        n_kv_heads=4,
        ffn_dim=2048,
        vocab_size=50_257,
        rope_theta=10_000.0,
        max_seq_len=1024,
        tie_embeddings=True,
    ),
    # Exactly 1,241,581,568 parameters (tied weight counted once).
    "1b": dict(
        n_layers=16,
        dim=2048,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=131_072,
        rope_theta=500_000.0,
        max_seq_len=8192,
        tie_embeddings=True,
    ),
    # Meta Llama-3 8B shapes (Llama-3.1's RoPE frequency scaling is not implemented).
    "8b": dict(
        n_layers=32,
        dim=4096,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14_336,
        vocab_size=128_256,
        rope_theta=500_000.0,
        max_seq_len=8192,
        tie_embeddings=False,
    ),
    # The size presets of the 1.46B-on-8xA100 seed document (tiny .. xlarge). The document
    # gives layers x width and a rounded parameter count only; the rest are Llama-style
    # choices that reproduce every count at the precision the document states: GQA with 4
    # key/value heads (2 for tiny, 5 for xlarge), head dim 64 (72 for medium-large, 96 for
    # large and xlarge), SwiGLU at 2.75 x dim (small: 2048 = 2.67 x), the GPT-2 vocabulary
    # padded to 50,304 (a multiple of 64), untied embeddings, RoPE 10,000, sequences up to
    # 2048. Exact counts (docs/models.md):
    "tiny": dict(  # 85,340,672 (document: 85M)
        n_layers=12,
        dim=512,
        n_heads=8,
        n_kv_heads=2,
        ffn_dim=1408,
        vocab_size=50_304,
        rope_theta=10_000.0,
        max_seq_len=2048,
        tie_embeddings=False,
    ),
    "small": dict(  # 177,955,584 (document: 178M)
        n_layers=16,
        dim=768,
        n_heads=12,
        n_kv_heads=4,
        ffn_dim=2048,
        vocab_size=50_304,
        rope_theta=10_000.0,
        max_seq_len=2048,
        tie_embeddings=False,
    ),
    "medium": dict(  # 373,605,376 (document: 374M)
        n_layers=24,
        dim=1024,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=2816,
        vocab_size=50_304,
        rope_theta=10_000.0,
        max_seq_len=2048,
        tie_embeddings=False,
    ),
    "medium-large": dict(  # 401,275,008 (document: 401M); head dim 72
        n_layers=20,
        dim=1152,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=3168,
        vocab_size=50_304,
        rope_theta=10_000.0,
        max_seq_len=2048,
        tie_embeddings=False,
    ),
    "large": dict(  # 763,307,520 (document: 763M); head dim 96
        n_layers=24,
        dim=1536,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=4224,
        vocab_size=50_304,
        rope_theta=10_000.0,
        max_seq_len=2048,
        tie_embeddings=False,
    ),
    "xlarge": dict(  # 1,461,413,760 (document: 1.46B); head dim 96
        n_layers=32,
        dim=1920,
        n_heads=20,
        n_kv_heads=5,
        ffn_dim=5280,
        vocab_size=50_304,
        rope_theta=10_000.0,
        max_seq_len=2048,
        tie_embeddings=False,
    ),
}


# Shapes beyond these are typos: 10 trillion parameters is far past any model trained so far, and
# 2^24 positions past any context trained. Refused before the model is built, which for such a
# shape would loop for hours over layers or ask for terabytes of RoPE tables.
MAX_PARAMETERS = 10**13
MAX_SEQ_LEN = 2**24


def check_masking(attention_mask: str, rope_positions: str) -> None:
    """The masking options' values (also refused by their Literal types when read from a config)."""
    if attention_mask not in ("causal", "document"):
        raise ValueError(f"attention_mask {attention_mask!r}: expected causal or document")
    if rope_positions not in ("absolute", "document"):
        raise ValueError(f"rope_positions {rope_positions!r}: expected absolute or document")
    if rope_positions == "document" and attention_mask != "document":
        raise ValueError('rope_positions = "document" needs attention_mask = "document"')


def check_size(max_seq_len: int, parameters: int, shape: str) -> None:
    """Refuse a shape of more than MAX_PARAMETERS parameters or a max_seq_len over MAX_SEQ_LEN."""
    if parameters > MAX_PARAMETERS:
        raise ValueError(f"{shape} make {parameters:.3g} parameters; expected at most {MAX_PARAMETERS:.0e}")
    if max_seq_len > MAX_SEQ_LEN:
        raise ValueError(f"max_seq_len must be at most {MAX_SEQ_LEN:,} (2^24), got {max_seq_len:,}")


def _from_flavor(value: Any) -> bool:
    """Whether an option is at its "from flavor" value: 0 (not False), 0.0 or "flavor"."""
    return value == "flavor" or (type(value) in (int, float) and value == 0)


Parametrization = Literal["standard", "mup"]


def parametrization_option() -> Any:
    """``parametrization``'s declaration, shared by every model spec that offers µP."""
    return option("standard", "standard, or mup: init, logit and attention multipliers and per-kind LRs scale with dim / mup_base_width (docs/mup.md)")


def mup_base_width_option() -> Any:
    return option(0, "mup: the dim the hyperparameters were tuned at, a divisor of dim (0: dim itself)", ge=0)


def mup_base_head_dim_option() -> Any:
    return option(0, "mup: the head dim at the base width (0: mup_base_width / n_heads, the same head count)", ge=0)


@dataclass
class Llama3Options:
    """Options of ``[model] name = "llama3"``, and, resolved (:meth:`resolved`), the model's arguments."""

    flavor: str = option("debug", f"named set of shapes: {', '.join(FLAVORS)}")
    n_layers: int = option(0, "transformer blocks (0: from flavor)", ge=0)
    dim: int = option(0, "model width (0: from flavor)", ge=0)
    n_heads: int = option(0, "query heads (0: from flavor)", ge=0)
    n_kv_heads: int = option(0, "key/value heads, divides n_heads (0: from flavor)", ge=0)
    ffn_dim: int = option(0, "SwiGLU hidden width (0: from flavor)", ge=0)
    vocab_size: int = option(0, "vocabulary size, > every token id of the data (0: from flavor)", ge=0)
    rope_theta: float = option(0.0, "RoPE base frequency (0: from flavor)", ge=0)
    max_seq_len: int = option(0, "longest sequence, length of the RoPE tables (0: from flavor)", ge=0)
    tie_embeddings: bool | Literal["flavor", "true", "false"] = option("flavor", "output head shares the token embedding matrix (flavor: the flavor's choice)")
    attention: Literal["sdpa", "flash_attn"] = option(
        "sdpa",
        "attention kernel: sdpa (torch, picks flash/cuDNN/memory-efficient) or flash_attn (the flash-attn package; falls back to sdpa with a logged reason)",
    )
    loss_chunk_tokens: int = option(0, "compute the loss this many tokens at a time so full logits never exist (0: off)", ge=0)
    attention_mask: Literal["causal", "document"] = option(
        "causal", "causal, or document: attention stays within each document of a packed sequence (needs the data's end-of-document id)"
    )
    rope_positions: Literal["absolute", "document"] = option(
        "absolute", "absolute, or document: RoPE positions restart at each document (needs attention_mask = document)"
    )
    norm_eps: float = option(1e-5, "RMSNorm epsilon", gt=0)
    init_std: float = option(0.02, "std of the token embedding at init", gt=0)
    qk_norm: bool = option(False, "RMSNorm over each head's queries and keys before RoPE, a weight of head_dim each (OLMo 2, Qwen3)")
    parametrization: Parametrization = parametrization_option()
    mup_base_width: int = mup_base_width_option()
    mup_base_head_dim: int = mup_base_head_dim_option()

    def resolved(self) -> "Llama3Options":
        """These options with the flavor's value for each one left at 0 or "flavor", tie_embeddings a
        bool, and the attention kernel one that imports here."""
        over = {k: v for k, v in FLAVORS[self.flavor].items() if _from_flavor(getattr(self, k))}
        over["tie_embeddings"] = over.get("tie_embeddings", self.tie_embeddings) in (True, "true")
        a = replace(self, **over, attention=resolve_attention(self.attention))
        base = a.mup_base_width or a.dim
        return replace(a, mup_base_width=base, mup_base_head_dim=a.mup_base_head_dim or base // max(a.n_heads, 1))

    @property
    def width_ratio(self) -> float:
        """base width / dim under µP (1.0 under standard parametrization), once resolved: the output
        logits' multiplier and the hidden matrices' AdamW LR multiplier."""
        return self.mup_base_width / self.dim if self.parametrization == "mup" else 1.0

    @property
    def attention_scale(self) -> float | None:
        """The attention scores' multiplier: under µP sqrt(base head dim) / head_dim (1/d, equal to
        1/sqrt(head_dim) at the base width); None (SDPA's 1/sqrt(head_dim)) under standard."""
        if self.parametrization != "mup" or self.mup_base_head_dim == self.head_dim:
            return None
        return math.sqrt(self.mup_base_head_dim) / self.head_dim

    @property
    def tied(self) -> bool:
        """Whether the head shares the embedding, once resolved (:meth:`resolved` makes it a bool)."""
        return self.tie_embeddings is True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def check(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"unknown flavor {self.flavor!r}; flavors: {', '.join(FLAVORS)}")
        check_masking(self.attention_mask, self.rope_positions)
        a = self.resolved()
        if a.dim % a.n_heads:
            raise ValueError(f"dim {a.dim} is not divisible by n_heads {a.n_heads}")
        if a.n_heads % a.n_kv_heads:
            raise ValueError(f"n_heads {a.n_heads} is not divisible by n_kv_heads {a.n_kv_heads}")
        if a.head_dim % 2:
            raise ValueError(f"head dim {a.head_dim} (dim / n_heads) must be even for RoPE")
        if a.parametrization == "mup" and a.dim % a.mup_base_width:
            raise ValueError(f"mup_base_width {a.mup_base_width} is not a divisor of dim {a.dim}; expected the width the hyperparameters were tuned at")
        shape = f"n_layers {a.n_layers}, dim {a.dim}, ffn_dim {a.ffn_dim} and vocab_size {a.vocab_size}"
        check_size(a.max_seq_len, param_counts(a)[0], shape)


def param_counts(a: Llama3Options) -> tuple[int, int]:
    """(total, non-embedding) parameters of resolved options; a tied weight counts once.

    Non-embedding leaves out the token embedding and, when untied, the output head (the convention
    of Kaplan et al. 2020)."""
    kv = a.n_kv_heads * a.head_dim
    attn = a.dim * a.dim * 2 + a.dim * kv * 2 + (2 * a.head_dim if a.qk_norm else 0)  # wq, wo + wk, wv (+ q_norm, k_norm)
    ffn = 3 * a.dim * a.ffn_dim
    per_layer = attn + ffn + 2 * a.dim  # two RMSNorm weights
    non_embedding = a.n_layers * per_layer + a.dim  # + final norm
    embedding = a.vocab_size * a.dim * (1 if a.tie_embeddings else 2)
    return non_embedding + embedding, non_embedding


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019); no bias, no mean."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, [max_seq_len, head_dim], in fp32.

    Frequency i (of head_dim / 2) is theta^(-2i / head_dim); each appears twice,
    once per half of the head, matching :func:`apply_rope`.
    """
    # Computed on the CPU, then moved: the same values on every device, and under a meta-device
    # build arange on meta would go through torch._refs (seconds of imports on a first call).
    target = device if device is not None else torch.get_default_device()
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device="cpu", dtype=torch.float32) / head_dim)
    pos = torch.arange(max_seq_len, device="cpu", dtype=torch.float32)
    angles = torch.outer(pos, freqs)  # [T, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, head_dim]
    return angles.cos().to(target), angles.sin().to(target)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + head_dim/2]) of x [B, T, H, head_dim] by position; math in fp32.

    ``cos``/``sin``: the tables [max_seq_len, head_dim], or already cut and shaped [1, T, 1, head_dim]
    (:meth:`Transformer.forward` does that once per forward instead of once per call)."""
    if cos.ndim == 2:
        T = x.shape[1]
        cos, sin = cos[None, :T, None, :], sin[None, :T, None, :]
    if x.dtype == torch.float32:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).type_as(x)


SDPA_BACKENDS = {0: "math", 1: "flash", 2: "memory-efficient", 3: "cuDNN", 4: "overrideable"}


def sdpa_backend(n_heads: int, head_dim: int, seq_len: int, dtype: torch.dtype, device: torch.device) -> str:
    """The kernel ``F.scaled_dot_product_attention`` picks for causal attention of this shape
    (torch's own choice function, the one SDPA calls); on CUDA it should be flash or cuDNN."""
    q = torch.empty(1, n_heads, seq_len, head_dim, dtype=dtype, device=device)
    return SDPA_BACKENDS.get(int(torch._fused_sdp_choice(q, q, q, None, 0.0, True)), "unknown")


def document_layout(input_ids: torch.Tensor, eod_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index, position within the document), both [B, T], of each token of packed
    sequences whose documents end with ``eod_id`` (the end-of-document token belongs to the document
    it ends; a sequence that starts mid-document starts a document). Computed on the device from
    the ids: the loader hands out ids only."""
    is_end = input_ids == eod_id
    doc = torch.cumsum(is_end, 1) - is_end.long()
    t = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    starts = torch.ones_like(is_end)
    starts[:, 1:] = is_end[:, :-1]
    first = torch.where(starts, t, torch.zeros_like(t)).cummax(1).values
    return doc, t - first


def document_mask(doc: torch.Tensor) -> Any:
    """Causal attention within each document (``doc`` [B, T] from :func:`document_layout`): on CUDA a
    FlexAttention BlockMask (blocks of other documents skipped), elsewhere a boolean [B, 1, T, T] mask
    for SDPA (FlexAttention has no CPU backward in torch 2.13)."""
    B, T = doc.shape
    if doc.is_cuda:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document(b, h, q, kv):
            return (kv <= q) & (doc[b, q] == doc[b, kv])

        return create_block_mask(same_document, B, None, T, T, device=doc.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


def attention_inputs(
    input_ids: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, args: Llama3Options, eod_id: int | None
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """RoPE cos and sin shaped for the blocks ([1, T, 1, D], or [B, T, 1, D] with positions restarting
    at each document) and the attention mask (None: causal) of one forward, made once for every block.
    ``eod_id``: the data's end-of-document id (None: the document mask is causal)."""
    T = input_ids.shape[1]
    if args.attention_mask != "document" or eod_id is None:
        return rope_cos[None, :T, None, :], rope_sin[None, :T, None, :], None
    doc, pos = document_layout(input_ids, eod_id)
    if args.rope_positions == "document":
        cos, sin = rope_cos[pos][:, :, None, :], rope_sin[pos][:, :, None, :]
    else:
        cos, sin = rope_cos[None, :T, None, :], rope_sin[None, :T, None, :]
    return cos, sin, document_mask(doc)


def vocab_parallel_output(logits: Any, labels: torch.Tensor | None) -> torch.Tensor:
    """The head's vocabulary-sharded logits (a DTensor, under tensor parallelism) as the forward's
    result: gathered for generation (no labels) and evaluation (no grad, one micro-batch's logits);
    in training, the mean cross-entropy (fp32) computed on the shards, under the parallelism's
    ``loss_parallel`` (its sync_context, forward and backward), never gathering the logits."""
    if labels is None or not torch.is_grad_enabled():
        full = logits.full_tensor()
        return full if labels is None else F.cross_entropy(full.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (n_kv_heads <= n_heads) and RoPE; with
    ``qk_norm``, queries and keys RMS-normalized per head before RoPE."""

    def __init__(self, args: Llama3Options):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.use_flash_attn = args.attention == "flash_attn"
        self.scale = args.attention_scale  # None: 1/sqrt(head_dim)
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any = None) -> torch.Tensor:
        """``mask``: None (causal), a boolean [B, 1, T, T] mask (True: attend) or a FlexAttention BlockMask
        (:func:`document_mask`)."""
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp (n_kv_heads / tp) of them
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask is not None and not isinstance(mask, torch.Tensor):  # a BlockMask (CUDA)
            from torch.nn.attention.flex_attention import flex_attention

            y = flex_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads
            )
            return self.wo(cast(torch.Tensor, y).transpose(1, 2).reshape(B, T, -1))
        if mask is None and self.use_flash_attn and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            from flash_attn import flash_attn_func  # GQA natively, [B, T, H, D] layout

            return self.wo(flash_attn_func(q, k, v, causal=True, softmax_scale=self.scale).reshape(B, T, -1))
        # Share each kv head with n_heads / n_kv_heads query heads. Repeating
        # explicitly (rather than SDPA's enable_gqa, which only the flash
        # kernel honours) keeps every SDPA backend available, fp32 included.
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, head_dim]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, args: Llama3Options):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    rope_cos: torch.Tensor  # registered buffers (declared for the type checker)
    rope_sin: torch.Tensor

    def __init__(self, args: Llama3Options, eod_id: int | None = None):
        """``args``: resolved options (:meth:`Llama3Options.resolved`); ``eod_id``: the data's
        end-of-document id, which ``attention_mask = "document"`` splits sequences at."""
        super().__init__()
        self.args = args
        self.eod_id = eod_id
        # init_weights() initializes it; skipping Embedding's own normal_ keeps a meta-device build fast
        # (normal_ on meta goes through torch._refs: about 2 s of imports on a first call)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim))
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self._attention_logged = False
        self.compile_loss = False  # set by Llama3Spec.compile_loss (train.compile): core.contract.losses compiles the loss
        self.vocab_parallel = False  # set by the tensor-parallel plan: the head's logits are vocabulary-sharded DTensors
        # Derived from the shapes, not learned: left out of state_dict, and
        # recomputed by init_buffers() after to_empty() leaves them garbage.
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def log_attention_backend(self, seq_len: int, device: torch.device) -> None:
        """Say which SDPA kernel the attention runs on (rank 0, stderr)."""
        if self.args.attention == "flash_attn":
            return
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else self.tok_embeddings.weight.dtype
        backend = sdpa_backend(self.args.n_heads, self.args.head_dim, seq_len, dtype, device)
        log.note(f"attention: SDPA {backend} kernel ({str(dtype).removeprefix('torch.')}, head_dim {self.args.head_dim}, seq {seq_len})")

    def tie_weights(self) -> None:
        """Make the output head share the embedding matrix, if tied.

        ``to_empty()`` from the meta device gives each module its own new
        Parameter, which silently unties them; init_weights() ties again.
        """
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self) -> None:
        """(Re)compute the RoPE tables in fp32 on the device the buffers live on."""
        a = self.args
        cos, sin = rope_tables(a.head_dim, a.max_seq_len, a.rope_theta, device=self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin  # assigning a registered buffer name replaces the buffer

    @torch.no_grad()
    def init_weights(self, init_std: float = 0.02) -> None:
        """Linears N(0, std 1/sqrt(fan_in)); the residual outputs (wo, w2) std
        dim^-0.5 / sqrt(2 n_layers); embeddings std init_std; norms (q/k norms too) 1; an
        untied head std dim^-0.5. Also ties the head again and recomputes the
        RoPE buffers, both lost by ``to_empty()``.

        Under µP the hidden matrices keep this init (variance 1/fan_in is µP's); the untied head is
        std base_width^-0.5 at every width, its logits multiplied by base_width / dim in forward."""
        a = self.args
        self.tie_weights()
        self.init_buffers()
        nn.init.normal_(self.tok_embeddings.weight, std=init_std)
        residual_std = a.dim**-0.5 / math.sqrt(2 * a.n_layers)
        for block in self.layers:
            layer = cast(Block, block)
            attn, ffn = layer.attention, layer.feed_forward
            for lin in (attn.wq, attn.wk, attn.wv, ffn.w1, ffn.w3):
                nn.init.normal_(lin.weight, std=lin.weight.shape[1] ** -0.5)
            nn.init.normal_(attn.wo.weight, std=residual_std)
            nn.init.normal_(ffn.w2.weight, std=residual_std)
            for norm in (attn.q_norm, attn.k_norm):
                if norm is not None:
                    norm.reset_parameters()
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        if not a.tie_embeddings:
            nn.init.normal_(self.output.weight, std=a.mup_base_width**-0.5 if a.parametrization == "mup" else a.dim**-0.5)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] or, given labels (-100: ignored), the mean cross-entropy (fp32)."""
        T = input_ids.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.args.max_seq_len}")
        if input_ids.is_cuda and not self._attention_logged:  # once, outside the compiled blocks
            self._attention_logged = True
            self.log_attention_backend(T, input_ids.device)
        h = self.tok_embeddings(input_ids)
        cos, sin, mask = attention_inputs(input_ids, self.rope_cos, self.rope_sin, self.args, self.eod_id)  # once for every block
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.head(h, labels)

    def head(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The final norm and the output layer on the last block's output ``h``: logits, or the mean
        cross-entropy given labels (the forward's end; a last pipeline stage's too)."""
        h = self.norm(h)
        if self.args.width_ratio != 1.0:  # µP's output multiplier, on the head's input: the chunked loss sees it too
            h = h * self.args.width_ratio
        if self.vocab_parallel:  # tensor parallel: the logits are sharded over the vocabulary
            return vocab_parallel_output(self.output(h), labels)
        if labels is None:
            return self.output(h)
        from core.api import chunked_cross_entropy, output_cross_entropy

        if self.args.loss_chunk_tokens > 0:
            return chunked_cross_entropy(h, self.output.weight, labels, self.args.loss_chunk_tokens, compile=self.compile_loss)
        return output_cross_entropy(h, self.output.weight, labels, compile=self.compile_loss)
