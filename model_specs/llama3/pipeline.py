"""Pipeline stages of the llama3 Transformer: the embedding on the first, the blocks split evenly
in order, the final norm and the head on the last (``pipeline_stages``, ``torch.distributed.pipelining``).

A stage's ``forward(h=None, *, tokens, labels, micro_batch=None)`` takes the previous stage's hidden
states (the first stage: nothing, it embeds ``tokens``), and returns its hidden states, or on the last
stage the mean cross-entropy of ``labels`` (``micro_batch``, the micro-batch's index in the step, is
not used). Every stage gets the micro-batch's ``tokens``: the RoPE positions and the document mask are
computed from them on each stage, as the whole model computes them once.

The model a rank keeps is pruned to its stages' modules, their names unchanged (``layers`` becomes a
``ModuleDict`` keyed by the block's index), so each rank's state dict holds only its own FQNs and a
DCP checkpoint of all stages is the whole model's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from core.api import ConfigError
from model_specs.llama3.model import Llama3Options, Transformer, attention_inputs


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """The blocks of each stage, in order, split as evenly as they go (the first stages one more)."""
    per, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + per + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def check_pipeline(args: Llama3Options, n_stages: int) -> None:
    """Refuse a stage count these shapes or options cannot split into (ConfigError, one line)."""
    if args.n_layers < n_stages:
        raise ConfigError(f"[parallelism]: {n_stages} pipeline stages but the model has {args.n_layers} layers; expected at most one stage per layer")
    if args.tied:
        raise ConfigError(
            f"[model] tie_embeddings with {n_stages} pipeline stages is not supported (the embedding and the head live on different stages); "
            "expected tie_embeddings = false"
        )


class Stage(nn.Module):
    """One pipeline stage: the modules of ``model`` it runs (shared with it, not copied)."""

    def __init__(self, model: Transformer, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.owner = [model]  # the whole model's buffers and head code, not a submodule of the stage
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, h: torch.Tensor | None = None, *, tokens: torch.Tensor, labels: torch.Tensor, micro_batch: torch.Tensor | None = None) -> torch.Tensor:
        model = self.owner[0]
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
        assert h is not None, "a stage after the first is given the previous stage's hidden states"
        cos, sin, mask = attention_inputs(tokens, model.rope_cos, model.rope_sin, model.args, model.eod_id)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        return h if self.output is None else model.head(h, labels)


def pipeline_stages(model: Transformer, stage_ids: list[int], n_stages: int) -> list[nn.Module]:
    """The stage modules of ``stage_ids`` (of ``n_stages``), and ``model`` pruned to their modules."""
    ranges = layer_ranges(model.args.n_layers, n_stages)
    stages: list[nn.Module] = [Stage(model, ranges[s], s == 0, s == n_stages - 1) for s in stage_ids]
    kept = [i for s in stage_ids for i in ranges[s]]
    model.layers = nn.ModuleDict({str(i): model.layers[i] for i in kept})  # type: ignore[assignment]  # names kept: layers.{i}
    drop_ends(model, stage_ids, n_stages)
    return stages


def drop_ends(model: nn.Module, stage_ids: list[int], n_stages: int) -> None:
    """Remove the embedding from a model whose rank lacks the first stage, and the final norm and head
    from one lacking the last (the other names do not change)."""
    none: Any = None
    if 0 not in stage_ids:
        model.register_module("tok_embeddings", none)
    if n_stages - 1 not in stage_ids:
        model.register_module("norm", none)
        model.register_module("output", none)
