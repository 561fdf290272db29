"""Giving a model built on the meta device real storage, with its weight ties kept.

``nn.Module.to_empty`` gives every module's parameters new storage one module
at a time, so a parameter shared by two modules (``lm_head.weight =
wte.weight``, the standard tie) comes out as two independent parameters and
the run would silently train an untied model. :func:`materialize` records
which attributes share a parameter before, and shares it again after.
"""

from __future__ import annotations

import torch
from torch import nn


def shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that hold the same Parameter object, two or more per group."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to_empty(device)``, then the ties that existed on the meta device, again."""
    ties = shared_parameters(model)
    model.to_empty(device=device)
    for (first_module, first_name), *others in ties:
        param = getattr(first_module, first_name)
        for module, name in others:
            setattr(module, name, param)
    return model
