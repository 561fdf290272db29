"""Pieces the parallelism plugins share."""

from __future__ import annotations

import torch
from torch import nn


def by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` with a gradient, grouped by the device mesh of the gradient (one group for plain
    tensors; expert parallel: the experts' mesh and FSDP's)."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return list(groups.values())


def grad_norm(groups: list[list[nn.Parameter]]) -> torch.Tensor:
    """The gradient norm of the :func:`by_mesh` groups, a plain tensor: normed per mesh, then together."""
    norms = []
    for group in groups:
        n = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)  # type: ignore[misc]  # grads are set
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)  # DTensor under fsdp2
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def clip_to_norm(groups: list[list[nn.Parameter]], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients of the :func:`by_mesh` groups so that their total ``norm`` is at most ``max_norm`` (> 0)."""
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm (DTensor-aware, over every mesh), clipped when ``max_norm > 0``."""
    groups = by_mesh(list(model.parameters()))
    if not groups:
        return torch.zeros(())
    norm = grad_norm(groups)
    if max_norm > 0:
        clip_to_norm(groups, max_norm, norm)
    return norm
