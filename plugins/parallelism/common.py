"""Pieces the parallelism plugins share."""

from __future__ import annotations

import math

import torch
from torch import nn


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm (DTensor-aware), clipped when ``max_norm > 0``."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
    if hasattr(norm, "full_tensor"):  # DTensor under fsdp2
        norm = norm.full_tensor()
    return norm
