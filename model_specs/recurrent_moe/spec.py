"""The ``recurrent_moe`` model spec: the ModelSpec protocol, built from :class:`RecurrentMoEOptions`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, cast

from torch import nn

from core.api import ConfigError
from model_specs.llama3.model import Llama3Options
from model_specs.llama3.spec import end_of_document
from model_specs.recurrent_moe.model import FLAVORS, MoEArgs, MoEBlock, RecurrentMoE, RecurrentMoEOptions
from model_specs.recurrent_moe.parallelize import check_tensor_parallel, parallelize_tensor
from model_specs.recurrent_moe.pipeline import check_pipeline, pipeline_stages


@dataclass
class RecurrentMoESpec:
    args: MoEArgs
    # The options its weights are trained for (a resume that changes one is refused); not the loss weights.
    architecture_options: ClassVar[tuple[str, ...]] = (
        "flavor",
        "dim",
        "ffn_dim",
        "n_prelude",
        "n_core",
        "n_coda",
        "n_loops",
        "n_experts",
        "top_k",
        "vocab_size",
        "parametrization",
        "mup_base_width",
        "mup_base_head_dim",
    )

    def resolved_architecture(self) -> dict[str, Any]:
        """What the weights compute, as built from the flavor and the options (a resume compares these,
        ``core.checkpoint.folders``): the loop and routing counts and the flavor's shapes."""
        a, b = self.args, self.args.base
        shapes = {
            k: getattr(b, k)
            for k in ("dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "norm_eps", "parametrization", "mup_base_width", "mup_base_head_dim")
            if b.parametrization == "mup" or not k.startswith("mup_")  # µP's base widths compute nothing under standard
        }
        return {
            "n_prelude": a.n_prelude,
            "n_core": a.n_core,
            "n_coda": a.n_coda,
            "n_loops": a.options.n_loops,
            "n_experts": a.options.n_experts,
            "top_k": a.options.top_k,
            **shapes,
        }

    @classmethod
    def from_options(cls, o: RecurrentMoEOptions) -> "RecurrentMoESpec":
        o.check()
        r, f = o.resolved(), FLAVORS[o.flavor]
        base = Llama3Options(
            n_layers=r.n_prelude + r.n_core + r.n_coda,
            dim=r.dim,
            n_heads=f["n_heads"],
            n_kv_heads=f["n_kv_heads"],
            ffn_dim=r.ffn_dim,
            vocab_size=r.vocab_size,
            rope_theta=f["rope_theta"],
            max_seq_len=f["max_seq_len"],
            attention_mask=r.attention_mask,
            rope_positions=r.rope_positions,
            tie_embeddings=False,
            parametrization=r.parametrization,
            mup_base_width=r.mup_base_width,
            mup_base_head_dim=r.mup_base_head_dim,
        ).resolved()  # the µP widths filled in (every shape is set)
        return cls(MoEArgs(r, base))

    def check_expert_parallel(self, ep: int) -> None:
        """Refuse an expert-parallel degree that does not divide the experts, or the dense dispatch
        (which runs every expert on every token: nothing to exchange)."""
        o = self.args.options
        if o.n_experts % ep:
            raise ConfigError(f"[parallelism] ep = {ep} does not divide [model] n_experts = {o.n_experts}; expected a divisor of n_experts")
        if o.dispatch != "sparse":
            raise ConfigError(f'[parallelism] ep = {ep} needs [model] dispatch = "sparse", not {o.dispatch!r}')

    def parallelize_experts(self, model: nn.Module, ep_mesh: Any) -> list[nn.Module]:
        """Each MoE layer keeps ``n_experts / ep`` experts per rank (:meth:`GroupedExperts.shard`); the router,
        attention and norms stay whole. Returns the layers' :class:`GroupedExperts`."""
        experts = [cast(MoEBlock, block).moe.experts for block in _inner(model).blocks()]
        for e in experts:
            e.shard(ep_mesh)
        return list(experts)

    def mup_widths(self) -> tuple[int, int] | None:
        """(dim, mup_base_width) under ``parametrization = "mup"``, None under standard (core.contract.mup).
        The router is a hidden matrix (its LR scales as the experts')."""
        b = self.args.base
        return (b.dim, b.mup_base_width) if b.parametrization == "mup" else None

    @property
    def vocab_size(self) -> int:
        return self.args.base.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.args.base.max_seq_len

    def use_end_of_document_id(self, eod_id: int | None) -> None:
        """The data's end-of-document id, given by the core before the model is built
        (``attention_mask = "document"`` refuses None)."""
        self.args = replace(self.args, eod_id=end_of_document(self.args.base.attention_mask, eod_id))

    def build(self) -> RecurrentMoE:
        return RecurrentMoE(self.args)

    def init_weights(self, model: nn.Module) -> None:
        _inner(model).init_weights()

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return _inner(model).blocks()

    def block_passes(self, model: nn.Module) -> int:
        """Blocks one forward applies: the prelude and coda once, the core ``n_loops`` times (of a
        pipeline stage's pruned model, what that stage runs)."""
        m = _inner(model)
        return len(m.prelude) + len(m.core) * self.args.options.n_loops + len(m.coda)

    def check_pipeline(self, n_stages: int) -> None:
        """Refuse more pipeline stages than the model's parts (ConfigError)."""
        check_pipeline(self.args, n_stages)

    def pipeline_stages(self, model: nn.Module, stage_ids: list[int], n_stages: int) -> list[nn.Module]:
        """The modules of pipeline stages ``stage_ids`` of ``n_stages``, ``model`` pruned to them
        (:mod:`model_specs.recurrent_moe.pipeline`)."""
        return pipeline_stages(_inner(model), stage_ids, n_stages)

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse a tensor-parallel degree the heads or the vocabulary cannot split into (ConfigError)."""
        check_tensor_parallel(self.args, tp)

    def parallelize_tensor(self, model: nn.Module, tp_mesh: Any) -> None:
        """Tensor + sequence parallelism over ``tp_mesh``, the MoE layers whole on every rank
        (:mod:`model_specs.recurrent_moe.parallelize`)."""
        parallelize_tensor(_inner(model), tp_mesh)

    def tensor_parallel_costs(self, tp: int, micro_batch: int, seq_len: int, bytes_per_element: int) -> dict[str, int]:
        """Under ``tp`` (core.plan): the MoE layers (router, experts) and the norms whole on every rank,
        their activations too; per applied block four sequence-parallel collectives of the residual
        stream around attention and two around the MoE layer (its input gathered forward, its output's
        gradient gathered backward), two each for the embedding and the head, each sending
        (tp - 1) / tp of it (ring)."""
        a, b = self.args, self.args.base
        layers = a.n_prelude + a.n_core + a.n_coda
        applied = a.applied_blocks
        tokens = micro_batch * seq_len
        moe = a.options.n_experts * (3 * b.dim * b.ffn_dim + b.dim)  # experts and router, per layer
        stream = tokens * b.dim * bytes_per_element
        whole = applied * tokens * 4 * b.ffn_dim * a.options.top_k * bytes_per_element  # the experts' saved activations
        return {
            "whole_params": layers * (moe + 2 * b.dim) + b.dim,
            "activation_bytes": whole + (self.activation_bytes(micro_batch, seq_len, bytes_per_element) - whole) // tp,
            "comm_bytes": (6 * applied + 4) * stream * (tp - 1) // tp,
        }

    def expert_parallel_costs(self, ep: int, micro_batch: int, seq_len: int, bytes_per_element: int) -> dict[str, int]:
        """Under ``ep`` (core.plan): the experts' parameters (all layers, all experts; ep splits them,
        FSDP shards each rank's part over the replicas), and what one rank sends in the all-to-alls of one
        micro-batch: per applied block its ``top_k`` routed rows of ``dim`` (dropless), out to the
        experts and back (2), forward and backward (2), ``(ep - 1) / ep`` of them to other ranks."""
        a, b = self.args, self.args.base
        layers = a.n_prelude + a.n_core + a.n_coda
        applied = a.applied_blocks
        rows = micro_batch * seq_len * a.options.top_k
        return {
            "expert_params": layers * a.options.n_experts * 3 * b.dim * b.ffn_dim,
            "comm_bytes": applied * rows * b.dim * bytes_per_element * 2 * 2 * (ep - 1) // ep,
        }

    def _active_params(self) -> int:
        """Parameters a token passes through: attention + top_k experts per applied block, head."""
        a, b = self.args, self.args.base
        attn = 2 * b.dim * b.dim + 2 * b.dim * b.n_kv_heads * b.head_dim
        per_block = attn + a.options.top_k * 3 * b.dim * b.ffn_dim + b.dim * a.options.n_experts
        applied = a.applied_blocks
        return applied * per_block + b.dim * b.vocab_size

    def flops_per_token(self, seq_len: int) -> float:
        """6 x active parameters per token (loops counted as applied) + attention's 12 x L x d x T."""
        a, b = self.args, self.args.base
        applied = a.applied_blocks
        return 6 * self._active_params() + 12 * applied * b.dim * seq_len

    def activation_bytes(self, micro_batch: int, seq_len: int, bytes_per_element: int) -> int:
        a, b = self.args, self.args.base
        applied = a.applied_blocks
        tokens = micro_batch * seq_len
        per_block = tokens * (10 * b.dim + 4 * b.ffn_dim * a.options.top_k) * bytes_per_element
        return applied * per_block + tokens * (3 * b.dim * bytes_per_element + 4 * b.vocab_size)


def _inner(model: nn.Module) -> RecurrentMoE:
    """The RecurrentMoE itself, under a wrapper that keeps it as ``.module``."""
    return cast(RecurrentMoE, getattr(model, "module", model))


__all__ = ["FLAVORS", "RecurrentMoEOptions", "RecurrentMoESpec"]
