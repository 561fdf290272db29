"""Pieces the parallelism plugins share."""

from __future__ import annotations

import math

import torch
from torch import nn


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm (DTensor-aware), clipped when ``max_norm > 0``. Gradients on different
    device meshes (expert parallel: the experts' and FSDP's) are normed per mesh, then together."""
    params = [p for p in model.parameters() if p.grad is not None]
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if len(by_mesh) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor under fsdp2
    norms = []
    for group in by_mesh.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], foreach=True)
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
