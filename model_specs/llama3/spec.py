"""The ``llama3`` model spec: flavors, options, and the numbers the core asks for.

A *flavor* is a named set of shapes (``debug``, ``50m``, ``1b``, ``8b``, and the
size presets ``tiny`` .. ``xlarge``, docs/models.md); any
shape option left at its "from flavor" value (0, or ``"flavor"``) keeps the
flavor's value, any other value overrides it::

    [model]
    name = "llama3"
    flavor = "debug"
    dim = 64          # override one shape
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, Literal

from torch import nn

from core.api import ConfigError, log, option
from model_specs.llama3.model import ModelArgs, Transformer


def resolve_attention(requested: str) -> str:
    """``flash_attn`` when the package imports, else ``sdpa`` with the reason logged once."""
    if requested != "flash_attn":
        return requested
    try:
        import flash_attn  # noqa: F401
    except ImportError as e:
        log.warn(f"model.attention = 'flash_attn' but flash-attn is not importable ({e}); using sdpa", once="llama3:flash_attn")
        return "sdpa"
    return "flash_attn"


FLAVORS: dict[str, ModelArgs] = {
    # Trains in seconds on a CPU; byte-level data uses ids < 257.
    "debug": ModelArgs(
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
    "50m": ModelArgs(
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
    "1b": ModelArgs(
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
    "8b": ModelArgs(
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
    "tiny": ModelArgs(  # 85,340,672 (document: 85M)
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
    "small": ModelArgs(  # 177,955,584 (document: 178M)
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
    "medium": ModelArgs(  # 373,605,376 (document: 374M)
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
    "medium-large": ModelArgs(  # 401,275,008 (document: 401M); head dim 72
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
    "large": ModelArgs(  # 763,307,520 (document: 763M); head dim 96
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
    "xlarge": ModelArgs(  # 1,461,413,760 (document: 1.46B); head dim 96
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


def with_end_of_document(args: ModelArgs, eod_id: int | None) -> ModelArgs:
    """``args`` told the data's end-of-document id; ConfigError when the document mask needs one and
    the data has none (before any process group or model is built, ``core.plan`` too)."""
    if args.attention_mask != "document":
        return args
    if eod_id is None:
        raise ConfigError(
            '[model].attention_mask = "document" needs the end-of-document id of the data, and the data source declares none '
            '(its end_of_document_id(), or the eos_id of its tokenizer()); expected a source of packed documents, or attention_mask = "causal"'
        )
    return replace(args, eod_id=eod_id)


def check_size(args: ModelArgs, parameters: int, shape: str) -> None:
    """Refuse a shape of more than MAX_PARAMETERS parameters or a max_seq_len over MAX_SEQ_LEN."""
    if parameters > MAX_PARAMETERS:
        raise ValueError(f"{shape} make {parameters:.3g} parameters; expected at most {MAX_PARAMETERS:.0e}")
    if args.max_seq_len > MAX_SEQ_LEN:
        raise ValueError(f"max_seq_len must be at most {MAX_SEQ_LEN:,} (2^24), got {args.max_seq_len:,}")


@dataclass
class Llama3Options:
    """Options of ``[model] name = "llama3"``."""

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

    def args(self) -> ModelArgs:
        """The flavor's shapes with the overrides applied (call check() first)."""
        base = FLAVORS[self.flavor]
        over: dict[str, Any] = {
            k: getattr(self, k) for k in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "rope_theta", "max_seq_len") if getattr(self, k)
        }
        if self.tie_embeddings != "flavor":  # TOML's true and false, or the strings
            over["tie_embeddings"] = self.tie_embeddings in (True, "true")
        return replace(
            base,
            norm_eps=self.norm_eps,
            attention=resolve_attention(self.attention),
            loss_chunk_tokens=self.loss_chunk_tokens,
            attention_mask=self.attention_mask,
            rope_positions=self.rope_positions,
            **over,
        )

    def check(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"unknown flavor {self.flavor!r}; flavors: {', '.join(FLAVORS)}")
        check_masking(self.attention_mask, self.rope_positions)
        a = self.args()
        if a.dim % a.n_heads:
            raise ValueError(f"dim {a.dim} is not divisible by n_heads {a.n_heads}")
        if a.n_heads % a.n_kv_heads:
            raise ValueError(f"n_heads {a.n_heads} is not divisible by n_kv_heads {a.n_kv_heads}")
        if a.head_dim % 2:
            raise ValueError(f"head dim {a.head_dim} (dim / n_heads) must be even for RoPE")
        shape = f"n_layers {a.n_layers}, dim {a.dim}, ffn_dim {a.ffn_dim} and vocab_size {a.vocab_size}"
        check_size(a, Llama3Spec(a).param_counts()[0], shape)


def _unwrap(model: nn.Module) -> Transformer:
    """The Transformer inside DDP (``.module``) or torch.compile (``._orig_mod``) wrappers.

    FSDP2's ``fully_shard`` changes the module in place, so it needs no unwrapping.
    """
    while not isinstance(model, Transformer):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            raise TypeError(f"expected a llama3 Transformer, got {type(model).__name__}")
        model = inner
    return model


@dataclass
class Llama3Spec:
    """One llama3 flavor with its overrides applied: implements ``core.contract.protocols.ModelSpec``."""

    args: ModelArgs
    flavor: str = "debug"
    init_std: float = 0.02
    # The options its weights are trained for (a resume that changes one is refused). Not rope_theta or
    # max_seq_len (a context extension), attention or loss_chunk_tokens (the same function), init_std.
    architecture_options: ClassVar[tuple[str, ...]] = (
        "flavor",
        "n_layers",
        "dim",
        "n_heads",
        "n_kv_heads",
        "ffn_dim",
        "vocab_size",
        "tie_embeddings",
        "norm_eps",
    )

    def resolved_architecture(self) -> dict[str, Any]:
        """The architecture options as built: the flavor's values where the config left 0 or "flavor"
        (a resume compares these, ``core.checkpoint.folders``). The flavor itself is no function."""
        return {name: getattr(self.args, name) for name in self.architecture_options if name != "flavor"}

    @classmethod
    def from_options(cls, opts: Llama3Options) -> "Llama3Spec":
        opts.check()
        return cls(args=opts.args(), flavor=opts.flavor, init_std=opts.init_std)

    @classmethod
    def from_flavor(cls, flavor: str, **overrides: Any) -> "Llama3Spec":
        """Shortcut for tests and scripts: ``Llama3Spec.from_flavor("debug", dim=64)``."""
        return cls.from_options(Llama3Options(flavor=flavor, **overrides))

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.args.max_seq_len

    # -- building ------------------------------------------------------------
    def build(self) -> Transformer:
        """The module on the current default device (meta under the core), weights uninitialized."""
        return Transformer(self.args)

    def init_weights(self, model: nn.Module) -> None:
        """Initialize weights, re-tie a tied head and recompute the RoPE buffers (after ``to_empty``)."""
        _unwrap(model).init_weights(self.init_std)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(_unwrap(model).layers)

    def use_end_of_document_id(self, eod_id: int | None) -> None:
        """The data's end-of-document id, given by the core before the model is built
        (``attention_mask = "document"`` refuses None)."""
        self.args = with_end_of_document(self.args, eod_id)

    def compile_loss(self, model: nn.Module) -> None:
        """Under ``train.compile``: the output projection and cross-entropy (chunked or not) run as
        a ``torch.compile`` graph (:mod:`core.contract.losses`)."""
        _unwrap(model).compile_loss = True

    # -- numbers ------------------------------------------------------------
    def param_counts(self) -> tuple[int, int]:
        """(total, non-embedding) from the shapes; a tied weight counts once.

        Non-embedding leaves out the token embedding and, when untied, the
        output head (the convention of Kaplan et al. 2020).
        """
        a = self.args
        kv = a.n_kv_heads * a.head_dim
        attn = a.dim * a.dim * 2 + a.dim * kv * 2  # wq, wo + wk, wv
        ffn = 3 * a.dim * a.ffn_dim
        per_layer = attn + ffn + 2 * a.dim  # two RMSNorm weights
        non_embedding = a.n_layers * per_layer + a.dim  # + final norm
        embedding = a.vocab_size * a.dim * (1 if a.tie_embeddings else 2)
        return non_embedding + embedding, non_embedding

    def flops_per_token(self, seq_len: int) -> float:
        """6 (N + V d) + 12 L d T (docs/metrics.md): N non-embedding params and the output
        projection's V x d matmul (tied or not; the embedding lookup is no matmul), forward +
        backward; 12 L d T the attention scores and weighted sum (PaLM appendix B, nanoGPT,
        torchtitan). The causal mask's halving is not counted, as is usual for MFU."""
        a = self.args
        return float(6 * (self.param_counts()[1] + a.vocab_size * a.dim) + 12 * a.n_layers * a.dim * seq_len)

    def activation_bytes(self, micro_batch: int, seq_len: int, bytes_per_element: int) -> int:
        """Rough activation memory kept for backward by one micro-batch (no checkpointing).

        Counting the tensors autograd saves per token of each block, in elements
        (d = dim, f = ffn_dim):

        * attention: RMSNorm input, normalized input and output (3d); q and k
          after RoPE and v, k and v repeated to n_heads for GQA (3d); the SDPA
          output fed to wo (d): 7d;
        * SwiGLU: RMSNorm (3d); w1 and w3 outputs, silu output and the product
          fed to w2 (4f): 3d + 4f;

        so ``n_layers * tokens * (10d + 4f) * bytes``, plus the head: the final
        RMSNorm (3d at ``bytes``) and the fp32 log-softmax of the logits
        (4 * vocab bytes). Flash/memory-efficient SDPA keeps no T x T attention
        matrix, so unlike Korthikanti et al. (2022) there is no term in
        heads * seq_len. Norm statistics and the SDPA logsumexp are left out:
        the tests check the estimate against the saved tensors measured in
        eager fp32 (within 5%).
        """
        a = self.args
        tokens = micro_batch * seq_len
        per_layer = tokens * (10 * a.dim + 4 * a.ffn_dim) * bytes_per_element
        head = tokens * (3 * a.dim * bytes_per_element + 4 * a.vocab_size)
        return int(a.n_layers * per_layer + head)

    def describe(self) -> dict[str, Any]:
        """Short summary for logs."""
        total, non_emb = self.param_counts()
        return {
            "flavor": self.flavor,
            **asdict(self.args),
            "params": total,
            "params_non_embedding": non_emb,
        }

    def hf_config(self) -> dict[str, Any]:
        """Fields of ``transformers.LlamaConfig`` for these shapes (for HF export)."""
        a = self.args
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_dim,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "num_hidden_layers": a.n_layers,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "rope_theta": float(a.rope_theta),
            "rms_norm_eps": a.norm_eps,
            "tie_word_embeddings": a.tie_embeddings,
            "max_position_embeddings": a.max_seq_len,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }

    def to_hf_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        """plait names -> ``LlamaForCausalLM`` names (tied head left out). A model trained with the
        document mask is said to be exported without it: transformers' Llama applies a causal mask only."""
        from model_specs.llama3.hf import to_hf

        if self.args.attention_mask == "document":
            log.warn(
                'this model trained with attention_mask = "document"; transformers\' LlamaForCausalLM does not apply that mask '
                "(causal attention over the whole input): give it one document per sequence"
                + (", with positions from 0 (rope_positions = document)" if self.args.rope_positions == "document" else ""),
                once="llama3:hf document mask",
            )
        return to_hf(sd, self.args.tie_embeddings)

    def from_hf_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        """``LlamaForCausalLM`` names -> plait names (tied head restored)."""
        from model_specs.llama3.hf import from_hf

        return from_hf(sd, self.args.tie_embeddings)


__all__ = ["FLAVORS", "Llama3Options", "Llama3Spec"]
