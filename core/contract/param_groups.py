"""Parameter groups shared by every optimizer plugin.

Each parameter gets a *kind*: ``embedding`` (owned by an ``nn.Embedding``,
tied output heads included), ``norm`` (owned by a module whose class name ends
in ``Norm``), ``bias`` (named ``*bias``) or ``matrix`` (everything else). An
optimizer that sets ``separate_output_head = True`` also gets ``output``: the
untied output head (:func:`core.contract.protocols.output_head_params`), which is
otherwise a ``matrix``. By default norms, biases and embeddings get no weight decay. Each kind may take a
learning-rate multiplier; LR schedules scale every group's LR together, so
multipliers hold for the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from core.contract.options import option

KINDS = ("matrix", "embedding", "norm", "bias")
OUTPUT = "output"  # the untied output head's kind, for an optimizer with separate_output_head


@dataclass
class OptimizerOptions:
    """Options every optimizer plugin shares; subclass it for your own and keep it as ``self.options``.

    The core makes the parameter groups from it and hands them to the optimizer's
    ``build(param_groups)``: one group per parameter kind that has parameters, in the order
    ``matrix``, ``embedding``, ``norm``, ``bias`` (kinds: ``help(core.api.ModelSpec)``), each a dict
    with the keys ``params`` (the kind's unique trainable parameters; a tied weight once),
    ``name`` (the kind), ``lr`` (``lr`` x ``lr_mult``), ``lr_mult`` (``lr_multipliers[kind]``, 1.0
    when not given) and ``weight_decay`` (0.0 for the kinds in ``no_decay``, else
    ``weight_decay``). Pass them to the torch optimizer as they are: the LR schedule scales every
    group's ``lr`` together, so the multipliers hold for the whole run.
    """

    lr: float = option(3e-4, "peak learning rate (the schedule multiplies it)", gt=0)
    weight_decay: float = option(0.1, "decoupled weight decay for the kinds not in no_decay", ge=0)
    no_decay: list[str] = option(["embedding", "norm", "bias"], "parameter kinds without weight decay")
    lr_multipliers: dict[str, float] = option({}, "LR multiplier per parameter kind (matrix, embedding, norm, bias)", ge=0)

    def check(self) -> None:
        for kind in list(self.no_decay) + list(self.lr_multipliers):
            if kind not in KINDS:
                raise ValueError(f"unknown parameter kind {kind!r}; kinds: {', '.join(KINDS)}")


def classify(model: nn.Module, output_head: tuple[nn.Parameter, ...] = ()) -> dict[str, list[nn.Parameter]]:
    """Unique trainable parameters by kind (a tied weight appears once, as embedding); the
    ``output_head`` parameters that are not embeddings are of kind ``output``."""
    head = {id(p) for p in output_head}
    kinds: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if isinstance(module, nn.Embedding):
                kind = "embedding"
            elif type(module).__name__.endswith("Norm"):
                kind = "norm"
            elif p_name.endswith("bias"):
                kind = "bias"
            else:
                kind = OUTPUT if id(p) in head else "matrix"
            key = id(p)
            if kinds.get(key) != "embedding":  # a tied weight stays an embedding
                kinds[key] = kind
            params[key] = p
    out: dict[str, list[nn.Parameter]] = {k: [] for k in (*KINDS, OUTPUT)}
    for key, p in params.items():
        out[kinds[key]].append(p)
    return out


def param_groups(
    model: nn.Module, opts: OptimizerOptions, output_head: tuple[nn.Parameter, ...] = (), mup: dict[str, float] | None = None, head_is_matrix: bool = False
) -> list[dict[str, Any]]:
    """One group per kind present (``params``, ``name``, ``lr``, ``lr_mult``, ``weight_decay``), in
    the order of :data:`KINDS`, ``output`` last. ``mup``: µP's multiplier per kind
    (:func:`core.contract.mup.lr_multipliers`), times the options' ``lr_multipliers``;
    ``head_is_matrix``: the head is split off for µP only, so the options' ``matrix`` multiplier is its."""
    groups = []
    for kind, params in classify(model, output_head).items():
        if not params:
            continue
        named = "matrix" if kind == OUTPUT and head_is_matrix else kind
        mult = float(opts.lr_multipliers.get(named, 1.0)) * (mup or {}).get(kind, 1.0)
        groups.append(
            {
                "params": params,
                "name": kind,
                "lr": opts.lr * mult,
                "lr_mult": mult,
                "weight_decay": 0.0 if named in opts.no_decay else opts.weight_decay,
            }
        )
    return groups
