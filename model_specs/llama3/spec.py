"""The ``llama3`` model spec: the numbers the core asks for, built from :class:`Llama3Options`.

A *flavor* is a named set of shapes (``debug``, ``50m``, ``1b``, ``8b``, and the
size presets ``tiny`` .. ``xlarge``, docs/models.md; :data:`FLAVORS`); any
shape option left at its "from flavor" value (0, or ``"flavor"``) keeps the
flavor's value, any other value overrides it::

    [model]
    name = "llama3"
    flavor = "debug"
    dim = 64          # override one shape
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from torch import nn

from core.api import ConfigError, log
from model_specs.llama3.model import FLAVORS, Llama3Options, Transformer, param_counts
from model_specs.llama3.parallelize import check_tensor_parallel, parallelize_tensor
from model_specs.llama3.pipeline import check_pipeline, pipeline_stages


def end_of_document(attention_mask: str, eod_id: int | None) -> int | None:
    """The data's end-of-document id the model needs (None with the causal mask); ConfigError when the
    document mask needs one and the data has none (before any process group or model is built,
    ``core.plan`` too)."""
    if attention_mask != "document":
        return None
    if eod_id is None:
        raise ConfigError(
            '[model].attention_mask = "document" needs the end-of-document id of the data, and the data source declares none '
            '(its end_of_document_id(), or the eos_id of its tokenizer()); expected a source of packed documents, or attention_mask = "causal"'
        )
    return eod_id


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
    """One llama3 flavor with its overrides applied: implements ``core.contract.protocols.ModelSpec``.
    ``args``: the resolved options (:meth:`Llama3Options.resolved`)."""

    args: Llama3Options
    eod_id: int | None = None  # the data's end-of-document id (use_end_of_document_id); None: the document mask is causal
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
        "qk_norm",
        "parametrization",
        "mup_base_width",
        "mup_base_head_dim",
    )

    def resolved_architecture(self) -> dict[str, Any]:
        """The architecture options as built: the flavor's values where the config left 0 or "flavor"
        (a resume compares these, ``core.checkpoint.folders``). The flavor itself is no function, nor
        are µP's base widths under standard parametrization."""
        unused = {"flavor"} | ({"mup_base_width", "mup_base_head_dim"} if self.args.parametrization != "mup" else set())
        return {name: getattr(self.args, name) for name in self.architecture_options if name not in unused}

    @classmethod
    def from_options(cls, opts: Llama3Options) -> "Llama3Spec":
        opts.check()
        return cls(args=opts.resolved())

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
        return Transformer(self.args, self.eod_id)

    def init_weights(self, model: nn.Module) -> None:
        """Initialize weights, re-tie a tied head and recompute the RoPE buffers (after ``to_empty``)."""
        _unwrap(model).init_weights(self.args.init_std)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        layers = _unwrap(model).layers  # a ModuleDict once split into pipeline stages
        return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)

    def use_end_of_document_id(self, eod_id: int | None) -> None:
        """The data's end-of-document id, given by the core before the model is built
        (``attention_mask = "document"`` refuses None)."""
        self.eod_id = end_of_document(self.args.attention_mask, eod_id)

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse a tensor-parallel degree these shapes or options cannot split into (ConfigError)."""
        check_tensor_parallel(self.args, tp)

    def tensor_parallel_costs(self, tp: int, micro_batch: int, seq_len: int, bytes_per_element: int) -> dict[str, int]:
        """Under ``tp`` (core.plan): the norms whole on every rank; activations / tp; per block four
        sequence-parallel collectives of the residual stream forward (all-gather into attention and the
        MLP, reduce-scatter out of ``wo`` and ``w2``) and four backward, two each for the embedding and
        the head, each sending (tp - 1) / tp of it (ring)."""
        a = self.args
        stream = micro_batch * seq_len * a.dim * bytes_per_element
        return {
            "whole_params": (2 * a.n_layers + 1) * a.dim + (2 * a.n_layers * a.head_dim if a.qk_norm else 0),
            "activation_bytes": self.activation_bytes(micro_batch, seq_len, bytes_per_element) // tp,
            "comm_bytes": (8 * a.n_layers + 4) * stream * (tp - 1) // tp,
        }

    def parallelize_tensor(self, model: nn.Module, tp_mesh: Any) -> None:
        """Tensor + sequence parallelism over ``tp_mesh`` (:mod:`model_specs.llama3.parallelize`)."""
        parallelize_tensor(_unwrap(model), tp_mesh)

    def check_pipeline(self, n_stages: int) -> None:
        """Refuse a pipeline stage count these shapes or options cannot split into (ConfigError)."""
        check_pipeline(self.args, n_stages)

    def pipeline_stages(self, model: nn.Module, stage_ids: list[int], n_stages: int) -> list[nn.Module]:
        """The modules of pipeline stages ``stage_ids`` of ``n_stages``, ``model`` pruned to them
        (:mod:`model_specs.llama3.pipeline`)."""
        return pipeline_stages(_unwrap(model), stage_ids, n_stages)

    def compile_loss(self, model: nn.Module) -> None:
        """Under ``train.compile``: the output projection and cross-entropy (chunked or not) run as
        a ``torch.compile`` graph (:mod:`core.contract.losses`)."""
        _unwrap(model).compile_loss = True

    def mup_widths(self) -> tuple[int, int] | None:
        """(dim, mup_base_width) under ``parametrization = "mup"`` (the core scales the LR of each
        parameter kind by them), None under standard. The model applies its own init, logit and
        attention multipliers (:class:`model_specs.llama3.model.Llama3Options`)."""
        a = self.args
        return (a.dim, a.mup_base_width) if a.parametrization == "mup" else None

    # -- numbers ------------------------------------------------------------
    def param_counts(self) -> tuple[int, int]:
        """(total, non-embedding) from the shapes (:func:`model_specs.llama3.model.param_counts`)."""
        return param_counts(self.args)

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
        * with ``qk_norm``: each norm's input and normalized output, for q (d) and
          k (the key/value width kv): 2 (d + kv);

        so ``n_layers * tokens * (10d + 4f [+ 2 (d + kv)]) * bytes``, plus the head: the final
        RMSNorm (3d at ``bytes``) and the fp32 log-softmax of the logits
        (4 * vocab bytes). Flash/memory-efficient SDPA keeps no T x T attention
        matrix, so unlike Korthikanti et al. (2022) there is no term in
        heads * seq_len. Norm statistics and the SDPA logsumexp are left out:
        the tests check the estimate against the saved tensors measured in
        eager fp32 (within 5%).
        """
        a = self.args
        tokens = micro_batch * seq_len
        qk_norm = 2 * (a.dim + a.n_kv_heads * a.head_dim) if a.qk_norm else 0
        per_layer = tokens * (10 * a.dim + 4 * a.ffn_dim + qk_norm) * bytes_per_element
        head = tokens * (3 * a.dim * bytes_per_element + 4 * a.vocab_size)
        return int(a.n_layers * per_layer + head)

    def describe(self) -> dict[str, Any]:
        """Short summary for logs."""
        total, non_emb = self.param_counts()
        return {
            **asdict(self.args),
            "params": total,
            "params_non_embedding": non_emb,
        }

    def hf_config(self) -> dict[str, Any]:
        """Fields of ``transformers.LlamaConfig`` for these shapes (for HF export); with ``qk_norm``,
        ``Qwen3Config``'s: Qwen3 is Llama's layout with a per-head RMSNorm on q and k before RoPE."""
        a = self.args
        return {
            "architectures": ["Qwen3ForCausalLM" if a.qk_norm else "LlamaForCausalLM"],
            "model_type": "qwen3" if a.qk_norm else "llama",
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
        """plait names -> ``LlamaForCausalLM`` (``Qwen3ForCausalLM``) names (tied head left out). A model trained with the
        document mask is said to be exported without it: transformers' Llama applies a causal mask only."""
        from model_specs.llama3.hf import to_hf

        if self.args.attention_mask == "document":
            log.warn(
                'this model trained with attention_mask = "document"; transformers\' LlamaForCausalLM does not apply that mask '
                "(causal attention over the whole input): give it one document per sequence"
                + (", with positions from 0 (rope_positions = document)" if self.args.rope_positions == "document" else ""),
                once="llama3:hf document mask",
            )
        return to_hf(self.mup_folded(sd, 1), self.args.tied)

    def mup_folded(self, sd: dict[str, Any], power: int) -> dict[str, Any]:
        """µP's multipliers folded into the weights (power 1; -1 unfolds): the head times the logit
        multiplier, and wq (q_norm with qk_norm) times attention_scale x sqrt(head_dim), so a model
        that scores with 1/sqrt(head_dim) and no logit multiplier (Hugging Face's) computes the same
        logits. A tied head at a width other than the base cannot fold (the embedding is the head):
        ValueError."""
        a = self.args
        out = dict(sd)
        if a.width_ratio != 1.0:
            if a.tied:
                raise ValueError(
                    f'parametrization = "mup" with a tied head at dim {a.dim} (mup_base_width {a.mup_base_width}): its logit multiplier '
                    "cannot fold into the weights (the head is the embedding); expected an untied head or the base width"
                )
            out["output.weight"] = sd["output.weight"] * a.width_ratio**power
        if a.attention_scale is not None:
            factor = (a.attention_scale * a.head_dim**0.5) ** power
            q = "attention.q_norm.weight" if a.qk_norm else "attention.wq.weight"
            for i in range(a.n_layers):
                out[f"layers.{i}.{q}"] = sd[f"layers.{i}.{q}"] * factor
        return out

    def from_hf_state_dict(self, sd: dict[str, Any]) -> dict[str, Any]:
        """``LlamaForCausalLM`` (``Qwen3ForCausalLM``) names -> plait names (tied head restored)."""
        from model_specs.llama3.hf import from_hf

        return self.mup_folded(from_hf(sd, self.args.tied), -1)


__all__ = ["FLAVORS", "Llama3Options", "Llama3Spec"]
