"""The ``recurrent_moe`` model spec: flavors, options and the ModelSpec protocol."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, cast

from torch import nn

from core.api import option
from model_specs.llama3.model import ModelArgs
from model_specs.llama3.spec import check_masking, check_size, with_end_of_document
from model_specs.recurrent_moe.model import MoEArgs, RecurrentMoE

FLAVORS: dict[str, dict[str, Any]] = {
    "debug": dict(
        dim=64,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=128,
        vocab_size=512,
        rope_theta=10_000.0,
        max_seq_len=1024,
        n_prelude=1,
        n_core=1,
        n_coda=1,
        n_loops=3,
        n_experts=4,
        top_k=2,
    ),
    "small": dict(
        dim=512,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=1024,
        vocab_size=50_257,
        rope_theta=10_000.0,
        max_seq_len=2048,
        n_prelude=2,
        n_core=2,
        n_coda=2,
        n_loops=4,
        n_experts=8,
        top_k=2,
    ),
}


@dataclass
class RecurrentMoEOptions:
    flavor: str = option("debug", "named set of shapes: debug, small")
    n_loops: int = option(0, "times the recurrent core is applied (0: from flavor)", ge=0)
    n_experts: int = option(0, "experts per MoE layer (0: from flavor)", ge=0)
    top_k: int = option(0, "experts each token is routed to (0: from flavor)", ge=0)
    vocab_size: int = option(0, "vocabulary size (0: from flavor)", ge=0)
    aux_weight: float = option(0.01, "weight of the load-balancing loss", ge=0)
    z_weight: float = option(0.001, "weight of the router z-loss (0 disables)", ge=0)
    attention_mask: Literal["causal", "document"] = option(
        "causal", "causal, or document: attention stays within each document of a packed sequence (needs the data's end-of-document id)"
    )
    rope_positions: Literal["absolute", "document"] = option(
        "absolute", "absolute, or document: RoPE positions restart at each document (needs attention_mask = document)"
    )
    dispatch: Literal["sparse", "dense"] = option(
        "sparse", "sparse: each expert runs on its routed tokens only; dense: every expert on every token (reference)"
    )
    capacity_factor: float = option(
        0.0, "0: dropless; >= 1: each expert takes at most ceil(factor x routed pairs / n_experts) per layer, the rest dropped", ge=0
    )

    def check(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"unknown flavor {self.flavor!r}; flavors: {', '.join(FLAVORS)}")
        check_masking(self.attention_mask, self.rope_positions)
        f = {**FLAVORS[self.flavor], **{k: v for k, v in (("n_experts", self.n_experts), ("top_k", self.top_k)) if v}}
        if not 1 <= f["top_k"] <= f["n_experts"]:
            raise ValueError(f"top_k {f['top_k']}: expected 1 to n_experts ({f['n_experts']})")
        if 0 < self.capacity_factor < 1:
            raise ValueError(f"capacity_factor {self.capacity_factor}: expected 0 (dropless) or at least 1")
        if self.capacity_factor and self.dispatch == "dense":
            raise ValueError('capacity_factor needs dispatch = "sparse" (the dense path drops nothing)')
        if self.vocab_size:
            f["vocab_size"] = self.vocab_size
        layers = f["n_prelude"] + f["n_core"] + f["n_coda"]
        per_layer = 4 * f["dim"] ** 2 + f["n_experts"] * (3 * f["dim"] * f["ffn_dim"] + f["dim"])  # at most: attention, experts, router
        shape = f"n_experts {f['n_experts']} of {layers} layers and vocab_size {f['vocab_size']}"
        check_size(
            ModelArgs(layers, f["dim"], f["n_heads"], f["n_kv_heads"], f["ffn_dim"], f["vocab_size"], 0.0, f["max_seq_len"]),
            layers * per_layer + 2 * f["vocab_size"] * f["dim"],
            shape,
        )


@dataclass
class RecurrentMoESpec:
    args: MoEArgs
    # The options its weights are trained for (a resume that changes one is refused); not the loss weights.
    architecture_options: ClassVar[tuple[str, ...]] = ("flavor", "n_loops", "n_experts", "top_k", "vocab_size")

    def resolved_architecture(self) -> dict[str, Any]:
        """What the weights compute, as built from the flavor and the options (a resume compares these,
        ``core.checkpoint.folders``): the loop and routing counts and the flavor's shapes."""
        a, b = self.args, self.args.base
        shapes = {k: getattr(b, k) for k in ("dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "norm_eps")}
        return {"n_prelude": a.n_prelude, "n_core": a.n_core, "n_coda": a.n_coda, "n_loops": a.n_loops, "n_experts": a.n_experts, "top_k": a.top_k, **shapes}

    @classmethod
    def from_options(cls, o: RecurrentMoEOptions) -> "RecurrentMoESpec":
        o.check()
        f = dict(FLAVORS[o.flavor])
        for key in ("n_loops", "n_experts", "top_k", "vocab_size"):
            if getattr(o, key):
                f[key] = getattr(o, key)
        base = ModelArgs(
            n_layers=f["n_prelude"] + f["n_core"] + f["n_coda"],
            dim=f["dim"],
            n_heads=f["n_heads"],
            n_kv_heads=f["n_kv_heads"],
            ffn_dim=f["ffn_dim"],
            vocab_size=f["vocab_size"],
            rope_theta=f["rope_theta"],
            max_seq_len=f["max_seq_len"],
            attention_mask=o.attention_mask,
            rope_positions=o.rope_positions,
        )
        return cls(
            MoEArgs(
                base,
                f["n_prelude"],
                f["n_core"],
                f["n_coda"],
                f["n_loops"],
                f["n_experts"],
                f["top_k"],
                o.aux_weight,
                o.z_weight,
                o.dispatch,
                o.capacity_factor,
            )
        )

    @property
    def vocab_size(self) -> int:
        return self.args.base.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.args.base.max_seq_len

    def use_end_of_document_id(self, eod_id: int | None) -> None:
        """The data's end-of-document id, given by the core before the model is built
        (``attention_mask = "document"`` refuses None)."""
        self.args = replace(self.args, base=with_end_of_document(self.args.base, eod_id))

    def build(self) -> RecurrentMoE:
        return RecurrentMoE(self.args)

    def init_weights(self, model: nn.Module) -> None:
        _inner(model).init_weights()

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return _inner(model).blocks()

    def _active_params(self) -> int:
        """Parameters a token passes through: attention + top_k experts per applied block, head."""
        a, b = self.args, self.args.base
        attn = 2 * b.dim * b.dim + 2 * b.dim * b.n_kv_heads * b.head_dim
        per_block = attn + a.top_k * 3 * b.dim * b.ffn_dim + b.dim * a.n_experts
        applied = a.n_prelude + a.n_core * a.n_loops + a.n_coda
        return applied * per_block + b.dim * b.vocab_size

    def flops_per_token(self, seq_len: int) -> float:
        """6 x active parameters per token (loops counted as applied) + attention's 12 x L x d x T."""
        a, b = self.args, self.args.base
        applied = a.n_prelude + a.n_core * a.n_loops + a.n_coda
        return 6 * self._active_params() + 12 * applied * b.dim * seq_len

    def activation_bytes(self, micro_batch: int, seq_len: int, bytes_per_element: int) -> int:
        a, b = self.args, self.args.base
        applied = a.n_prelude + a.n_core * a.n_loops + a.n_coda
        tokens = micro_batch * seq_len
        per_block = tokens * (10 * b.dim + 4 * b.ffn_dim * a.top_k) * bytes_per_element
        return applied * per_block + tokens * (3 * b.dim * bytes_per_element + 4 * b.vocab_size)


def _inner(model: nn.Module) -> RecurrentMoE:
    """The RecurrentMoE itself, under a wrapper that keeps it as ``.module``."""
    return cast(RecurrentMoE, getattr(model, "module", model))
