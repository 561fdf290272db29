"""Pipeline stages of the recurrent_moe model: it splits between its units, each prelude block, the
looped core (whose weights every loop reuses, so it stays on one stage) and each coda block
(:func:`model_specs.recurrent_moe.model.units`), as evenly as they go in order; the embedding goes
with the first stage and the final norm and head with the last (``pipeline_stages``,
``torch.distributed.pipelining``).

A stage's ``forward(h=None, aux=None, z=None, *, tokens, labels, micro_batch=None)`` takes the previous
stage's hidden states and its running sums of the load-balancing and router z-losses (the first stage:
nothing, it embeds ``tokens``) and returns the three, or on the last stage the model's loss. RoPE and
the document mask are computed from ``tokens`` on each stage. The units a rank does not hold are
removed (a part it holds in part becomes a ``ModuleDict`` keyed by the block's index), so the names of
the rest do not change and each rank's state dict holds only its own.

Each stage records the step metrics of what it runs (its blocks' routing, the loop cosines where it
holds the core, the loss parts on the last stage) under its index and ``micro_batch``, and
:meth:`RecurrentMoE.step_metrics` combines the ranks' records into the values of the same step
without pipelining.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from core.api import ConfigError
from model_specs.llama3.pipeline import drop_ends, layer_ranges
from model_specs.recurrent_moe.model import MoEArgs, RecurrentMoE, units

PARTS = ("prelude", "core", "coda")


def check_pipeline(args: MoEArgs, n_stages: int) -> None:
    """Refuse more stages than the model has units (ConfigError, one line)."""
    n = len(units(args))
    if n_stages > n:
        raise ConfigError(
            f"[parallelism]: {n_stages} pipeline stages but recurrent_moe splits only between its {n} units (each of its {args.n_prelude} prelude "
            f"and {args.n_coda} coda blocks, and the looped core, which stays on one stage); expected at most {n} stages"
        )


class Stage(nn.Module):
    """One pipeline stage: the units of ``model`` it runs (shared with it, not copied)."""

    def __init__(self, model: RecurrentMoE, index: int, held: list[str], first: bool, last: bool) -> None:
        super().__init__()
        self.owner = [model]  # the whole model's buffers and code, not a submodule of the stage
        self.index, self.held = index, held
        self.tok_embeddings = model.tok_embeddings if first else None
        for part in PARTS:
            mine = {unit: model.get_submodule(unit) for unit in held if unit.partition(".")[0] == part}
            if part == "core" and mine:
                self.register_module(part, model.core)
            elif mine:
                self.register_module(part, nn.ModuleDict({unit.partition(".")[2]: block for unit, block in mine.items()}))
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(
        self,
        h: torch.Tensor | None = None,
        aux: torch.Tensor | None = None,
        z: torch.Tensor | None = None,
        *,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        micro_batch: torch.Tensor | None = None,
    ) -> Any:
        carried = None if self.tok_embeddings is not None else (h, aux, z)
        assert carried is None or None not in carried, "a stage after the first is given the previous stage's outputs"
        return self.owner[0].run(self.held, tokens, labels, carried, head=self.output is not None, piece=self.index, slot=micro_batch)  # type: ignore[arg-type]


def pipeline_stages(model: RecurrentMoE, stage_ids: list[int], n_stages: int) -> list[nn.Module]:
    """The stage modules of ``stage_ids`` (of ``n_stages``), and ``model`` pruned to their units."""
    every = units(model.args)
    ranges = layer_ranges(len(every), n_stages)
    stages: list[nn.Module] = [Stage(model, s, [every[i] for i in ranges[s]], s == 0, s == n_stages - 1) for s in stage_ids]
    kept = {every[i] for s in stage_ids for i in ranges[s]}
    for part in PARTS:
        mine = sorted((u for u in kept if u.partition(".")[0] == part), key=lambda u: every.index(u))
        if part == "core" or not mine:
            if not mine:
                model.register_module(part, nn.ModuleList())
            continue
        model.register_module(part, nn.ModuleDict({u.partition(".")[2]: model.get_submodule(u) for u in mine}))
    drop_ends(model, stage_ids, n_stages)
    return stages
