"""A looped mixture-of-experts transformer: prelude, a recurrent core applied n_loops times, coda.

Attention, RoPE and RMSNorm are llama3's. Each block's FFN is a mixture of
SwiGLU experts with top-k routing (softmax over the chosen k). Training
minimizes ``lm + aux_weight x load_balance + z_weight x router_z`` (Switch
Transformer's balance loss, ST-MoE's z-loss). The model keeps, detached,
what monitors need: each loss part, tokens per expert, router entropy, the
spread of expert outputs, and the cosine similarity of consecutive loop states.

These are accumulated on the device over the micro-batches of a training step
(no host sync per micro-batch; validation and other no-grad forwards are not
counted) and handed to the core on log steps by :meth:`RecurrentMoE.step_metrics`,
which says how each is reduced across ranks (docs/metrics.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from core.api import option
from model_specs.llama3.model import (
    Attention,
    Llama3Options,
    Parametrization,
    RMSNorm,
    attention_inputs,
    check_masking,
    check_size,
    mup_base_head_dim_option,
    mup_base_width_option,
    parametrization_option,
    rope_tables,
    vocab_parallel_output,
)
from model_specs.recurrent_moe.experts import GroupedExperts

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


def _from_flavor(value: Any) -> bool:
    """Whether an option is at its "from flavor" value (0)."""
    return type(value) in (int, float) and value == 0


@dataclass
class RecurrentMoEOptions:
    """Options of ``[model] name = "recurrent_moe"``, and, resolved (:meth:`resolved`), the model's."""

    flavor: str = option("debug", f"named set of shapes: {', '.join(FLAVORS)}")
    dim: int = option(0, "model width (0: from flavor)", ge=0)
    ffn_dim: int = option(0, "each expert's SwiGLU hidden width (0: from flavor)", ge=0)
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
    parametrization: Parametrization = parametrization_option()
    mup_base_width: int = mup_base_width_option()
    mup_base_head_dim: int = mup_base_head_dim_option()

    def resolved(self) -> "RecurrentMoEOptions":
        """These options with the flavor's value for each one left at 0."""
        names = {f.name for f in fields(self)}
        return replace(self, **{k: v for k, v in FLAVORS[self.flavor].items() if k in names and _from_flavor(getattr(self, k))})

    def check(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"unknown flavor {self.flavor!r}; flavors: {', '.join(FLAVORS)}")
        check_masking(self.attention_mask, self.rope_positions)
        r, f = self.resolved(), FLAVORS[self.flavor]
        if not 1 <= r.top_k <= r.n_experts:
            raise ValueError(f"top_k {r.top_k}: expected 1 to n_experts ({r.n_experts})")
        if 0 < self.capacity_factor < 1:
            raise ValueError(f"capacity_factor {self.capacity_factor}: expected 0 (dropless) or at least 1")
        if self.capacity_factor and self.dispatch == "dense":
            raise ValueError('capacity_factor needs dispatch = "sparse" (the dense path drops nothing)')
        if r.dim % f["n_heads"] or (r.dim // f["n_heads"]) % 2:
            raise ValueError(f"dim {r.dim}: expected a multiple of 2 x n_heads ({f['n_heads']}), for an even head dim")
        if r.parametrization == "mup" and r.mup_base_width and r.dim % r.mup_base_width:
            raise ValueError(f"mup_base_width {r.mup_base_width} is not a divisor of dim {r.dim}; expected the width the hyperparameters were tuned at")
        layers = f["n_prelude"] + f["n_core"] + f["n_coda"]
        per_layer = 4 * r.dim**2 + r.n_experts * (3 * r.dim * r.ffn_dim + r.dim)  # at most: attention, experts, router
        shape = f"n_experts {r.n_experts} of {layers} layers and vocab_size {r.vocab_size}"
        check_size(f["max_seq_len"], layers * per_layer + 2 * r.vocab_size * r.dim, shape)


@dataclass(frozen=True)
class MoEArgs:
    """The model's arguments: its options resolved from the flavor, and the flavor's shapes beside them."""

    options: RecurrentMoEOptions  # resolved (RecurrentMoEOptions.resolved)
    base: Llama3Options  # attention and expert shapes shared with llama3, from the flavor (n_layers unused)
    n_prelude: int
    n_core: int
    n_coda: int
    eod_id: int | None = None  # the data's end-of-document id (use_end_of_document_id); None: the document mask is causal


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (softmax over all experts, renormalized over the chosen k).

    ``dispatch = "sparse"`` runs each expert on the tokens routed to it only
    (:mod:`model_specs.recurrent_moe.experts`): dropless, or at most a capacity factor's share of
    the routed pairs per expert; under expert parallelism the rows travel to the rank holding their
    expert. ``"dense"`` runs every expert on every token and mixes the outputs with the routing
    weights (zero for an expert not chosen): the same function without drops, at ``n_experts / top_k``
    times the FFN work. Routing, losses and statistics are the same on every path.

    The collapse probe (the spread of every expert's output on the same 16 tokens) runs only when
    :attr:`probe` is set: on the training micro-batches of log steps (:meth:`RecurrentMoE.log_step`)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, dispatch: str = "sparse", capacity_factor: float = 0.0):
        super().__init__()
        self.top_k = top_k
        self.dispatch = dispatch
        self.capacity_factor = capacity_factor  # 0: dropless
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, n_experts)
        self.probe = False
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()
        probs = logits.softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        n = self.experts.n_experts
        counts = F.one_hot(chosen, n).sum((0, 1))
        probe = x[:16].detach() if self.probe else None
        if self.dispatch == "sparse":
            out, spread = self.routed(x, weights, chosen, counts, probe)
        else:
            out, spread = self.dense(x, probs, weights, chosen), self.experts.spread(probe) if probe is not None else None
        # Switch balance loss: n x sum_e (fraction of routed tokens) x (mean router prob)
        frac = counts.float() / chosen.numel()
        aux = n * (frac * probs.mean(0)).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        with torch.no_grad():
            entropy = -(probs * probs.clamp_min(1e-9).log()).sum(-1).mean()
            self.stats = {"counts": counts.detach(), "entropy": entropy}
            if spread is not None:
                self.stats["spread"] = spread
        return out.reshape(shape), aux, z

    def dense(self, x: torch.Tensor, probs: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, mixed by the routing weights."""
        gates = torch.zeros_like(probs).scatter(1, chosen, weights).to(x.dtype)  # [tokens, experts]
        out = torch.zeros_like(x)
        for e in range(self.experts.n_experts):
            out = out + self.experts.one(e, x) * gates[:, e, None]
        return out

    def routed(
        self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, counts: torch.Tensor, probe: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each (token, expert) pair computed by its expert alone, grouped by expert; and the experts'
        spread on the ``probe`` rows when given."""
        k = self.top_k
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        expert = chosen.reshape(-1)
        order = expert.argsort(stable=True)  # pairs grouped by expert, in token order within a group
        token = order // k
        gate = weights.reshape(-1)[order]
        y, kept, spread = self.experts(x[token].to(dtype), expert[order], counts, self.capacity_factor, probe)
        if kept is not None:
            gate = gate * kept
        y = y * gate[:, None].to(y.dtype)
        return torch.zeros(x.shape, dtype=y.dtype, device=x.device).index_add(0, token, y).to(x.dtype), spread


class MoEBlock(nn.Module):
    def __init__(self, a: MoEArgs):
        super().__init__()
        b = a.base
        self.attention_norm = RMSNorm(b.dim, b.norm_eps)
        self.attention = Attention(b)
        self.ffn_norm = RMSNorm(b.dim, b.norm_eps)
        self.moe = MoE(b.dim, b.ffn_dim, a.options.n_experts, a.options.top_k, a.options.dispatch, a.options.capacity_factor)

    def forward(self, x, cos, sin, mask=None):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        y, aux, z = self.moe(self.ffn_norm(x))
        return x + y, aux, z


def loop_cosines(states: list[torch.Tensor]) -> torch.Tensor:
    """Mean per-token cosine similarity of consecutive loop states (a 1-dim tensor, on the device)."""
    return torch.stack([F.cosine_similarity(a.float(), b.float(), dim=-1).mean() for a, b in zip(states, states[1:])])


# How each accumulated value is reduced over the micro-batches of a step and then over the ranks
# (core.contract.metrics.reduce_parts): loss parts and entropy are means, the health minima are minima,
# tokens per expert are summed (over the whole log window: the dead-expert check counts windows).
PART_OPS: dict[str, str] = {"lm": "mean", "aux": "mean", "z": "mean", "entropy": "mean", "loop_cos": "min", "spread": "min", "counts": "sum"}


class RecurrentMoE(nn.Module):
    rope_cos: torch.Tensor  # registered buffers (declared for the type checker)
    rope_sin: torch.Tensor

    def __init__(self, a: MoEArgs):
        super().__init__()
        self.args = a
        b = a.base
        # init_weights() initializes it; skipping Embedding's own normal_ keeps a meta-device build fast
        # (normal_ on meta goes through torch._refs: about 2 s of imports on a first call)
        self.tok_embeddings = nn.Embedding(b.vocab_size, b.dim, _weight=torch.empty(b.vocab_size, b.dim))
        self.prelude = nn.ModuleList(MoEBlock(a) for _ in range(a.n_prelude))
        self.core = nn.ModuleList(MoEBlock(a) for _ in range(a.n_core))
        self.coda = nn.ModuleList(MoEBlock(a) for _ in range(a.n_coda))
        self.norm = RMSNorm(b.dim, b.norm_eps)
        self.output = nn.Linear(b.dim, b.vocab_size, bias=False)
        cos, sin = rope_tables(b.head_dim, b.max_seq_len, b.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._parts: dict[str, torch.Tensor] = {}  # this step's sums (means) or minima, on the device
        self._micro = 0  # micro-batches in self._parts
        self._counts: torch.Tensor | None = None  # tokens per expert since the last step_metrics()
        self.vocab_parallel = False  # set by the tensor-parallel plan: the head's logits are vocabulary-sharded DTensors
        self.tensor_parallel = 1  # set by the tensor-parallel plan: ranks that route the same tokens
        self.probing = True  # the coming step is a log step (log_step); without the trainer's word, every step

    def blocks(self) -> list[nn.Module]:
        return [*self.prelude, *self.core, *self.coda]

    def log_step(self, on: bool) -> None:
        """Whether the coming training step is a log step: the collapse probe (every expert on 16 of each
        micro-batch's tokens, for ``moe/expert_spread_min``) runs on log steps' micro-batches only."""
        self.probing = on

    def init_weights(self, init_std: float = 0.02) -> None:
        b = self.args.base
        cos, sin = rope_tables(b.head_dim, b.max_seq_len, b.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        nn.init.normal_(self.tok_embeddings.weight, std=init_std)
        depth = len(self.prelude) + len(self.core) * self.args.options.n_loops + len(self.coda)
        residual_std = b.dim**-0.5 / math.sqrt(2 * depth)
        for block in cast("list[MoEBlock]", self.blocks()):
            at, moe = block.attention, block.moe
            for lin in (at.wq, at.wk, at.wv, moe.router):
                nn.init.normal_(lin.weight, std=lin.weight.shape[1] ** -0.5)
            nn.init.normal_(at.wo.weight, std=residual_std)
            nn.init.normal_(moe.experts.w1, std=b.dim**-0.5)
            nn.init.normal_(moe.experts.w3, std=b.dim**-0.5)
            nn.init.normal_(moe.experts.w2, std=residual_std)
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        nn.init.normal_(self.output.weight, std=b.mup_base_width**-0.5 if b.parametrization == "mup" else b.dim**-0.5)  # µP: constant in width

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        a = self.args
        probe = labels is not None and torch.is_grad_enabled() and self.probing  # a training micro-batch of a log step
        for block in cast("list[MoEBlock]", self.blocks()):
            block.moe.probe = probe
        h = self.tok_embeddings(input_ids)
        aux = h.new_zeros((), dtype=torch.float32)
        z = h.new_zeros((), dtype=torch.float32)
        cos, sin, mask = attention_inputs(input_ids, self.rope_cos, self.rope_sin, a.base, a.eod_id)  # once for every block

        def run(blocks, h, aux, z):
            for block in blocks:
                h, a_, z_ = block(h, cos, sin, mask)
                aux, z = aux + a_, z + z_
            return h, aux, z

        h, aux, z = run(self.prelude, h, aux, z)
        states = [h.detach()]
        for _ in range(a.options.n_loops):
            h, aux, z = run(self.core, h, aux, z)
            states.append(h.detach())
        h, aux, z = run(self.coda, h, aux, z)
        return self.head(h, labels, aux, z, states)

    def head(self, h: torch.Tensor, labels: torch.Tensor | None, aux: torch.Tensor, z: torch.Tensor, states: list[torch.Tensor] | None) -> torch.Tensor:
        """The final norm and the output layer on the last block's output ``h``: logits, or the loss given
        labels, with ``aux`` and ``z`` summed over every applied block (the forward's end; a last pipeline
        stage's too). ``states``: the hidden states around the loops, for this step's metrics (None: not
        recorded, as under pipeline parallelism, where no rank sees them all)."""
        a = self.args
        h = self.norm(h)
        logits = self.output(h * a.base.width_ratio if a.base.width_ratio != 1.0 else h)  # µP's output multiplier
        if labels is None:
            return vocab_parallel_output(logits, None) if self.vocab_parallel else logits
        n_moe = a.n_prelude + a.n_core * a.options.n_loops + a.n_coda  # every applied block, on whichever stage
        aux, z = aux / n_moe, z / n_moe
        if self.vocab_parallel:
            lm = vocab_parallel_output(logits, labels)
        else:
            lm = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        if torch.is_grad_enabled() and states is not None:  # a training micro-batch (validation runs under no_grad)
            self.accumulate(lm.detach(), aux.detach(), z.detach(), states)
        return lm + a.options.aux_weight * aux + a.options.z_weight * z

    @torch.no_grad()
    def accumulate(self, lm: torch.Tensor, aux: torch.Tensor, z: torch.Tensor, states: list[torch.Tensor]) -> None:
        """Add one training micro-batch to this step's parts, on the device (no host sync). The first
        micro-batch of a step is the one that finds no gradient yet (the trainer zeroes gradients with
        ``set_to_none`` after every step), so the parts always describe the last step."""
        if self.tok_embeddings.weight.grad is None:
            self._parts, self._micro = {}, 0
        blocks = cast("list[MoEBlock]", self.blocks())
        cos = loop_cosines(states).min() if len(states) > 1 else lm.new_ones(())
        now = {
            "lm": lm.float(),
            "aux": aux.float(),
            "z": z.float(),
            "entropy": torch.stack([b.moe.stats["entropy"] for b in blocks]).float().mean(),
            "loop_cos": cos.float(),
        }
        if all("spread" in b.moe.stats for b in blocks):  # a log step's micro-batch: it probed the experts
            now["spread"] = torch.stack([b.moe.stats["spread"] for b in blocks]).float().min()
        for key, value in now.items():
            old = self._parts.get(key)
            if old is None:
                self._parts[key] = value
            else:
                self._parts[key] = torch.minimum(old, value) if PART_OPS[key] == "min" else old + value
        self._micro += 1
        counts = cast(torch.Tensor, sum(block.moe.stats["counts"] for block in blocks))
        self._counts = counts if self._counts is None else self._counts + counts

    def step_metrics(self, reduce) -> dict[str, float | list[int]]:
        """Loss parts and health of the last training step, reduced over its micro-batches here and over
        the ranks by ``reduce`` ({name: (op, tensor)} -> {name: tensor}, one collective; the core's
        :func:`core.contract.metrics.reduce_parts`); tokens per expert since the last call. Empty before any
        training step."""
        if not self._parts or self._counts is None:
            return {}
        parts = {key: (PART_OPS[key], value / self._micro if PART_OPS[key] == "mean" else value) for key, value in self._parts.items()}
        parts["counts"] = ("sum", self._counts.double() / self.tensor_parallel)  # the ranks of a tensor-parallel group route the same tokens
        got = reduce(parts)
        self._counts = None
        counts = got["counts"].double()
        spread = {"moe/expert_spread_min": float(got["spread"])} if "spread" in got else {}  # a step whose first micro-batch probed
        return {
            "lm": float(got["lm"]),
            "aux": float(got["aux"]),
            "z": float(got["z"]),
            "moe/loop_cos_min": float(got["loop_cos"]),
            **spread,
            "moe/load_imbalance": float(counts.max() / counts.mean().clamp(min=1e-9)),
            "moe/router_entropy": float(got["entropy"]),
            "moe/expert_tokens": [int(c) for c in counts.tolist()],
        }

    def extra_metrics(self) -> dict[str, float | list[int]]:
        """:meth:`step_metrics` of this rank alone (no communication)."""
        return self.step_metrics(lambda parts: {key: value for key, (_, value) in parts.items()})
