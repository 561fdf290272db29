"""A looped mixture-of-experts transformer: prelude, a recurrent core applied n_loops times, coda.

Attention, RoPE and RMSNorm are llama3's. Each block's FFN is a mixture of
SwiGLU experts with top-k routing (softmax over the chosen k). Training
minimizes ``lm + aux_weight x load_balance + z_weight x router_z`` (Switch
Transformer's balance loss, ST-MoE's z-loss). The model keeps, detached,
what monitors need: each loss part, tokens per expert, router entropy, the
spread of expert outputs, and the cosine similarity of consecutive loop states.

These are recorded on the device for each training micro-batch by the piece of the
model that ran it (the whole model, or under pipeline parallelism each stage: its
blocks' routing, the loop cosines where it holds the core, the loss parts where it
holds the head; :class:`StepRecords`), with no host sync per micro-batch (validation
and other no-grad forwards are not recorded), and handed to the core on log steps by
:meth:`RecurrentMoE.step_metrics` as sums with their weights and minima, so that
reduced over the ranks they are the values of the same step on one process
(docs/metrics.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, cast

import torch
import torch.distributed as tdist
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
    n_prelude: int = option(0, "blocks before the recurrent core, applied once (0: from flavor)", ge=0)
    n_core: int = option(0, "blocks of the recurrent core, applied n_loops times (0: from flavor)", ge=0)
    n_coda: int = option(0, "blocks after the recurrent core, applied once (0: from flavor)", ge=0)
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
        layers = r.n_prelude + r.n_core + r.n_coda
        per_layer = 4 * r.dim**2 + r.n_experts * (3 * r.dim * r.ffn_dim + r.dim)  # at most: attention, experts, router
        shape = f"n_experts {r.n_experts} of {layers} layers and vocab_size {r.vocab_size}"
        check_size(f["max_seq_len"], layers * per_layer + 2 * r.vocab_size * r.dim, shape)


@dataclass(frozen=True)
class MoEArgs:
    """The model's arguments: its options resolved from the flavor, and the flavor's shapes beside them."""

    options: RecurrentMoEOptions  # resolved (RecurrentMoEOptions.resolved)
    base: Llama3Options  # attention and expert shapes shared with llama3, from the flavor (n_layers unused)
    eod_id: int | None = None  # the data's end-of-document id (use_end_of_document_id); None: the document mask is causal

    @property
    def n_prelude(self) -> int:
        return self.options.n_prelude

    @property
    def n_core(self) -> int:
        return self.options.n_core

    @property
    def n_coda(self) -> int:
        return self.options.n_coda

    @property
    def applied_blocks(self) -> int:
        """Block applications of one forward: the prelude and coda once, the core ``n_loops`` times."""
        return self.n_prelude + self.n_core * self.options.n_loops + self.n_coda


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


def units(a: MoEArgs) -> list[str]:
    """The model's units in forward order, named as its modules: each prelude block, the looped core
    as one (its weights serve every loop), each coda block; a pipeline stage holds whole units."""
    core = ["core"] if a.n_core else []
    return [f"prelude.{i}" for i in range(a.n_prelude)] + core + [f"coda.{i}" for i in range(a.n_coda)]


class StepRecords:
    """What the training micro-batches of a step showed, recorded on the device by each piece of the model
    that ran them (``"model"``, or a pipeline stage's index), one row per micro-batch: sums with their
    weights (:data:`SUMS`: the loss parts and the micro-batches whose loss the piece computed, the router
    entropy summed over its blocks and their count), minima (:data:`MINIMA`: the loop cosine where the
    piece holds the core, the expert spread on a probing micro-batch; +inf elsewhere) and tokens per
    expert. A row given a ``slot`` (the micro-batch's index in the step, a one-element tensor) replaces
    an earlier row of the same piece and slot: a pipeline schedule's first step runs each stage once
    more on placeholder inputs to infer shapes, before that micro-batch; rows without one (the whole
    model's) are combined into one as they come. A step's rows start with the trainer's ``log_step``
    (:meth:`new_step`); tokens per expert are also kept over the log window (every step since the last
    :meth:`take`)."""

    SUMS = ("lm", "aux", "z", "losses", "entropy", "blocks")
    MINIMA = ("loop_cos", "spread")

    def __init__(self) -> None:
        self.rows: dict[Any, list[tuple[torch.Tensor | None, torch.Tensor]]] = {}  # piece: (slot, row) in order
        self.window: torch.Tensor | None = None  # tokens per expert of the window's finished steps
        self.taken: torch.Tensor | None = None  # this step's tokens per expert already reported (take)

    def add(self, piece: Any, slot: torch.Tensor | None, row: torch.Tensor) -> None:
        rows = self.rows.setdefault(piece, [])
        if slot is None and rows:  # nothing to replace: one row of the piece's sums, minima and counts so far
            n, m = len(self.SUMS), len(self.SUMS) + len(self.MINIMA)
            last = rows[-1][1]
            rows[-1] = (None, torch.cat([last[:n] + row[:n], torch.minimum(last[n:m], row[n:m]), last[m:] + row[m:]]))
        else:
            rows.append((slot, row))

    def new_step(self) -> None:
        """The coming training step starts with no rows; the last step's tokens per expert join the window."""
        counts = self.counts()
        if counts is not None:
            self.window = counts if self.window is None else self.window + counts
        self.rows, self.taken = {}, None

    def step(self) -> torch.Tensor | None:
        """This rank's step as one row: the sums summed, the minima minimized, tokens per expert summed, over
        the kept rows of every piece (no host sync); None without rows."""
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for pieces in self.rows.values():
            rows = torch.stack([row for _, row in pieces])
            keep = torch.ones(len(pieces), dtype=torch.bool, device=rows.device)
            if all(slot is not None for slot, _ in pieces):  # a row replaced by a later row of its slot is left out
                slots = torch.cat([cast(torch.Tensor, slot).reshape(1) for slot, _ in pieces]).to(rows.device)
                later = torch.ones(len(pieces), len(pieces), dtype=torch.bool, device=rows.device).triu(1)
                keep = ~((slots[:, None] == slots[None, :]) & later).any(1)
            kept.append((rows, keep))
        if not kept:
            return None
        rows, keep = torch.cat([r for r, _ in kept]), torch.cat([k for _, k in kept])[:, None]
        n, m = len(self.SUMS), len(self.SUMS) + len(self.MINIMA)
        left_out = ~keep  # a placeholder's row may hold NaN: filled, not multiplied by 0
        sums = rows.masked_fill(left_out, 0.0)
        minima = rows[:, n:m].masked_fill(left_out, float("inf")).amin(0)
        return torch.cat([sums[:, :n].sum(0), minima, sums[:, m:].sum(0)])

    def counts(self, step: torch.Tensor | None = None) -> torch.Tensor | None:
        """This step's tokens per expert not yet reported (of ``step``, its row, if given)."""
        step = self.step() if step is None else step
        if step is None:
            return None
        counts = step[len(self.SUMS) + len(self.MINIMA) :]
        return counts if self.taken is None else counts - self.taken

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The last step's sums and minima, and tokens per expert since the last take (the log window);
        None before any training micro-batch."""
        step = self.step()
        if step is None:
            return None
        n, m = len(self.SUMS), len(self.SUMS) + len(self.MINIMA)
        counts = cast(torch.Tensor, self.counts(step))
        window = counts if self.window is None else self.window + counts
        self.window, self.taken = None, step[m:]
        return step[:n], step[n:m], window


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
        self.records = StepRecords()  # this step's micro-batches, and tokens per expert of the log window
        self.vocab_parallel = False  # set by the tensor-parallel plan: the head's logits are vocabulary-sharded DTensors
        self.tensor_parallel = 1  # set by the tensor-parallel plan: ranks that route the same tokens
        self.tensor_parallel_group: Any = None  # and their process group, each holding a sequence shard of the residual stream
        self.probing = True  # the coming step is a log step (log_step); without the trainer's word, every step

    def blocks(self) -> list[nn.Module]:
        return [block for unit in units(self.args) if self.holds(unit) for block in self.unit_blocks(unit)]

    def holds(self, unit: str) -> bool:
        """Whether this model (pruned to its pipeline stages, or whole) holds ``unit``."""
        part, _, index = unit.partition(".")
        modules = getattr(self, part)
        return bool(len(modules)) and (not index or (index in modules if isinstance(modules, nn.ModuleDict) else int(index) < len(modules)))

    def unit_blocks(self, unit: str) -> list[nn.Module]:
        """The blocks of ``unit`` ("prelude.0", "core", "coda.1"; :func:`units`)."""
        module = self.get_submodule(unit)
        return list(module.values()) if isinstance(module, nn.ModuleDict) else list(module) if isinstance(module, nn.ModuleList) else [module]

    def log_step(self, on: bool) -> None:
        """A training step begins (the trainer says so before every step): its records start empty, and
        the collapse probe (every expert on 16 of each micro-batch's tokens, for ``moe/expert_spread_min``)
        runs on its micro-batches when it is a log step (``on``)."""
        self.records.new_step()
        self.probing = on

    def init_weights(self, init_std: float = 0.02) -> None:
        b = self.args.base
        cos, sin = rope_tables(b.head_dim, b.max_seq_len, b.rope_theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        nn.init.normal_(self.tok_embeddings.weight, std=init_std)
        depth = self.args.applied_blocks
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
        return self.run(units(self.args), input_ids, labels)

    def run(
        self,
        run_units: list[str],
        tokens: torch.Tensor,
        labels: torch.Tensor | None,
        carried: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        head: bool = True,
        piece: Any = "model",
        slot: torch.Tensor | None = None,
    ) -> Any:
        """``run_units`` (in order, :func:`units`) on a micro-batch: from the embedding of ``tokens``, or
        from ``carried`` (the hidden states and the running load-balancing and z-loss sums of the units
        before), to the head's loss given ``labels`` (logits without) when ``head``, else the carried
        three. A training micro-batch (labels, gradients on) is recorded as ``piece``'s (:class:`StepRecords`).
        The whole model's forward, and each pipeline stage's."""
        a = self.args
        training = labels is not None and torch.is_grad_enabled()  # validation runs under no_grad
        blocks = cast("list[MoEBlock]", [block for unit in run_units for block in self.unit_blocks(unit)])
        for block in blocks:
            block.moe.probe = training and self.probing  # a training micro-batch of a log step
        if carried is None:
            h = self.tok_embeddings(tokens)
            aux = z = h.new_zeros((), dtype=torch.float32)
        else:
            h, aux, z = carried
        cos, sin, mask = attention_inputs(tokens, self.rope_cos, self.rope_sin, a.base, a.eod_id)  # once for every block
        states: list[torch.Tensor] | None = None  # the hidden states around the loops, where the core runs
        for unit in run_units:
            if unit == "core":
                states = [h.detach()]
            for _ in range(a.options.n_loops if unit == "core" else 1):
                for block in cast("list[MoEBlock]", self.unit_blocks(unit)):
                    h, a_, z_ = block(h, cos, sin, mask)
                    aux, z = aux + a_, z + z_
                if states is not None and unit == "core":
                    states.append(h.detach())
        if not head:
            out: Any = (h, aux, z)
            losses = None
        else:
            out, losses = self.head(h, labels, aux, z)
        if training:
            self.record(piece, slot, blocks, states, losses)
        return out

    def head(
        self, h: torch.Tensor, labels: torch.Tensor | None, aux: torch.Tensor, z: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """The final norm and the output layer on the last block's output ``h``: logits, or the loss given
        labels, with ``aux`` and ``z`` summed over every applied block; and the loss parts (lm, aux, z;
        None without labels)."""
        a = self.args
        h = self.norm(h)
        logits = self.output(h * a.base.width_ratio if a.base.width_ratio != 1.0 else h)  # µP's output multiplier
        if labels is None:
            return (vocab_parallel_output(logits, None) if self.vocab_parallel else logits), None
        n_moe = a.applied_blocks  # every applied block, on whichever stage
        aux, z = aux / n_moe, z / n_moe
        if self.vocab_parallel:
            lm = vocab_parallel_output(logits, labels)
        else:
            lm = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return lm + a.options.aux_weight * aux + a.options.z_weight * z, (lm, aux, z)

    @torch.no_grad()
    def record(
        self,
        piece: Any,
        slot: torch.Tensor | None,
        blocks: list[MoEBlock],
        states: list[torch.Tensor] | None,
        losses: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """One training micro-batch as ``piece`` saw it, one row of :class:`StepRecords` on the device (no
        host sync): its ``blocks``' router entropy and tokens per expert (each block's last application),
        the loop cosines of ``states`` (None: the core ran elsewhere), the loss parts (None: the head is
        elsewhere), the expert spread if every block probed."""
        device = blocks[0].moe.stats["entropy"].device

        def const(value: float) -> torch.Tensor:
            return torch.full((), value, dtype=torch.float64, device=device)

        lm, aux, z = (x.double() for x in losses) if losses is not None else (const(0.0),) * 3
        cos = const(float("inf") if states is None else 1.0)  # the core ran elsewhere; no loops
        if states is not None and len(states) > 1:
            per_loop = loop_cosines(states).double()
            if self.tensor_parallel > 1:  # a sequence shard of the residual stream: the mean over the tp group's (equal) shards
                tdist.all_reduce(per_loop, group=self.tensor_parallel_group)
                per_loop = per_loop / self.tensor_parallel
            cos = per_loop.min()
        probed = all("spread" in b.moe.stats for b in blocks)  # a log step's micro-batch
        spread = torch.stack([b.moe.stats["spread"] for b in blocks]).double().min() if probed else const(float("inf"))
        entropy = torch.stack([b.moe.stats["entropy"] for b in blocks]).double().sum()
        row = [lm, aux, z, const(float(losses is not None)), entropy, const(float(len(blocks))), cos, spread]  # StepRecords.SUMS, MINIMA
        counts = torch.stack([b.moe.stats["counts"] for b in blocks]).sum(0).double()
        self.records.add(piece, slot, torch.cat([torch.stack(row), counts]))

    def step_metrics(self, reduce) -> dict[str, float | list[int]]:
        """Loss parts and health of the last training step over every micro-batch and rank, and tokens per
        expert since the last call: each rank's sums with their weights, minima and counts
        (:class:`StepRecords`) reduced over the ranks by ``reduce`` ({name: (op, tensor)} -> {name: tensor},
        one collective; the core's :func:`core.contract.metrics.reduce_parts}`), the sums then divided by
        their weights. Under pipeline parallelism each rank gives what its stages saw (zero weights, +inf
        minima for the rest), so the values are those without it. Empty before any training step."""
        taken = self.records.take()
        if taken is None:
            return {}
        sums, minima, counts = taken
        got = reduce({"sums": ("sum", sums), "minima": ("min", minima), "counts": ("sum", counts / self.tensor_parallel)})  # tp ranks route the same tokens
        s = dict(zip(StepRecords.SUMS, got["sums"].tolist()))
        cos, spread = got["minima"].tolist()
        counts = got["counts"].double().round()
        losses = {key: s[key] / s["losses"] for key in ("lm", "aux", "z")} if s["losses"] else {}  # none: a stage's own view, without the head
        return {
            **losses,
            "moe/loop_cos_min": cos if math.isfinite(cos) else 1.0,  # no loops: 1
            **({"moe/expert_spread_min": spread} if math.isfinite(spread) else {}),  # a step whose micro-batches probed
            "moe/load_imbalance": float(counts.max() / counts.mean().clamp(min=1e-9)),
            "moe/router_entropy": s["entropy"] / s["blocks"],
            "moe/expert_tokens": [int(c) for c in counts.tolist()],
        }

    def extra_metrics(self) -> dict[str, float | list[int]]:
        """:meth:`step_metrics` of this rank alone (no communication)."""
        return self.step_metrics(lambda parts: {key: value for key, (_, value) in parts.items()})
