"""Pipeline stages of the recurrent_moe model: it splits between its parts only, the prelude, the
looped core (whose weights every loop reuses, so it stays on one stage) and the coda, the embedding
with the first and the final norm and head with the last (``pipeline_stages``,
``torch.distributed.pipelining``).

A stage's ``forward(h=None, aux=None, z=None, *, tokens, labels)`` takes the previous stage's hidden
states and its running sums of the load-balancing and router z-losses (the first stage: nothing, it
embeds ``tokens``) and returns the three, or on the last stage the model's loss. RoPE and the document
mask are computed from ``tokens`` on each stage. The parts a rank does not hold become empty module
lists, so the names of the rest do not change and each rank's state dict holds only its own.

Under pipeline parallelism the model's step metrics (loss parts, MoE health) are not recorded: no rank
sees every block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from core.api import ConfigError
from model_specs.llama3.model import attention_inputs
from model_specs.llama3.pipeline import drop_ends, layer_ranges
from model_specs.recurrent_moe.model import MoEArgs, RecurrentMoE

PARTS = ("prelude", "core", "coda")


def parts(args: MoEArgs) -> list[str]:
    """The model's non-empty parts, in order: the units a stage split keeps whole."""
    sizes = {"prelude": args.n_prelude, "core": args.n_core, "coda": args.n_coda}
    return [p for p in PARTS if sizes[p]]


def check_pipeline(args: MoEArgs, n_stages: int) -> None:
    """Refuse more stages than the model has parts (ConfigError, one line)."""
    units = parts(args)
    if n_stages > len(units):
        raise ConfigError(
            f"[parallelism]: {n_stages} pipeline stages but recurrent_moe splits only between its {len(units)} parts ({', '.join(units)}; "
            f"the looped core stays on one stage); expected at most {len(units)} stages"
        )


class Stage(nn.Module):
    """One pipeline stage: the parts of ``model`` it runs (shared with it, not copied)."""

    def __init__(self, model: RecurrentMoE, held: list[str], first: bool, last: bool) -> None:
        super().__init__()
        self.owner = [model]  # the whole model's buffers and head code, not a submodule of the stage
        self.held = held
        self.tok_embeddings = model.tok_embeddings if first else None
        for part in held:
            self.register_module(part, getattr(model, part))
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(
        self, h: torch.Tensor | None = None, aux: torch.Tensor | None = None, z: torch.Tensor | None = None, *, tokens: torch.Tensor, labels: torch.Tensor
    ) -> Any:
        model = self.owner[0]
        a = model.args
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            aux = z = h.new_zeros((), dtype=torch.float32)
        assert h is not None and aux is not None and z is not None, "a stage after the first is given the previous stage's outputs"
        cos, sin, mask = attention_inputs(tokens, model.rope_cos, model.rope_sin, a.base, a.eod_id)
        for part in self.held:
            for _ in range(a.options.n_loops if part == "core" else 1):
                for block in getattr(self, part):
                    h, a_, z_ = block(h, cos, sin, mask)
                    aux, z = aux + a_, z + z_
        if self.output is None:
            return h, aux, z
        return model.head(h, labels, aux, z, None)


def pipeline_stages(model: RecurrentMoE, stage_ids: list[int], n_stages: int) -> list[nn.Module]:
    """The stage modules of ``stage_ids`` (of ``n_stages``), and ``model`` pruned to their parts."""
    units = parts(model.args)
    ranges = layer_ranges(len(units), n_stages)
    stages: list[nn.Module] = [Stage(model, [units[i] for i in ranges[s]], s == 0, s == n_stages - 1) for s in stage_ids]
    kept = {units[i] for s in stage_ids for i in ranges[s]}
    for part in PARTS:
        if part not in kept:
            model.register_module(part, nn.ModuleList())
    drop_ends(model, stage_ids, n_stages)
    return stages
