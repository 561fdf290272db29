"""Routed SwiGLU experts computed on the tokens routed to them only.

The router's (token, expert) pairs are sorted by expert (a stable sort: ties keep token order),
so each expert's tokens are one contiguous group of rows, and the experts' weights are stacked
into ``[n_experts, ...]`` tensors. Three ways to run the groups, one result:

* :func:`grouped_swiglu`: dropless; every row goes through its own expert. On CUDA in bf16 with
  16-byte aligned widths it is ``torch._grouped_mm`` (one kernel per projection, as torchtitan's MoE).
  Elsewhere it is the custom op ``plait::grouped_swiglu``: a loop over the experts' row groups with a
  hand-written backward (``torch._grouped_mm`` has no CPU backward in torch 2.13). To dynamo the op
  is one node whose output shape is its input's, so a compiled block has no graph break.
* :func:`capacity_swiglu`: with a capacity factor, each expert takes at most
  ``ceil(factor x routed pairs / n_experts)`` rows (first come, in token order); the rest are dropped
  (that pair adds nothing to the token's output). The rows sit in a fixed ``[n_experts, capacity, dim]``
  buffer: batched matmuls of static shape.

Parameter names stay those of the dense model (``experts.{e}.w1.weight`` ...): the stacking happens
in the forward, so checkpoints of either path load into the other.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.library.custom_op("plait::grouped_swiglu", mutates_args=())
def _grouped_swiglu(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``x`` [R, d] grouped by expert (``counts`` [E] rows each, in order); ``w1``, ``w3`` [E, h, d],
    ``w2`` [E, d, h]. Returns the output [R, d] and the two projections [R, h] the backward needs."""
    out = x.new_empty(x.shape)
    h1 = x.new_empty(x.shape[0], w1.shape[1])
    h3 = x.new_empty(x.shape[0], w1.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            rows = x[start : start + n]
            a, b = rows @ w1[e].t(), rows @ w3[e].t()
            h1[start : start + n], h3[start : start + n] = a, b
            out[start : start + n] = (F.silu(a) * b) @ w2[e].t()
        start += n
    return out, h1, h3


@_grouped_swiglu.register_fake
def _(x, counts, w1, w3, w2):
    return x.new_empty(x.shape), x.new_empty(x.shape[0], w1.shape[1]), x.new_empty(x.shape[0], w1.shape[1])


@torch.library.custom_op("plait::grouped_swiglu_backward", mutates_args=())
def _grouped_swiglu_backward(
    grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, h1: torch.Tensor, h3: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`_grouped_swiglu`'s output for x, w1, w3, w2 (an expert without rows gets zeros)."""
    dx = torch.zeros_like(x)
    dw1, dw3, dw2 = torch.zeros_like(w1), torch.zeros_like(w3), torch.zeros_like(w2)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            rows, dy = x[start : start + n], grad[start : start + n]
            a, b = h1[start : start + n], h3[start : start + n]
            sig = torch.sigmoid(a)
            s = a * sig  # silu(a)
            dw2[e] = dy.t() @ (s * b)
            dg = dy @ w2[e]
            da = dg * b * (sig * (1 + a * (1 - sig)))  # silu'(a)
            db = dg * s
            dw1[e], dw3[e] = da.t() @ rows, db.t() @ rows
            dx[start : start + n] = da @ w1[e] + db @ w3[e]
        start += n
    return dx, dw1, dw3, dw2


@_grouped_swiglu_backward.register_fake
def _(grad, x, counts, w1, w3, w2, h1, h3):
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w3), torch.empty_like(w2)


def _setup_context(ctx, inputs, output):
    x, counts, w1, w3, w2 = inputs
    _, h1, h3 = output
    ctx.save_for_backward(x, counts, w1, w3, w2, h1, h3)


def _backward(ctx, grad, _grad_h1, _grad_h3):
    x, counts, w1, w3, w2, h1, h3 = ctx.saved_tensors
    dx, dw1, dw3, dw2 = _grouped_swiglu_backward(grad.contiguous(), x, counts, w1, w3, w2, h1, h3)
    return dx, None, dw1, dw3, dw2


_grouped_swiglu.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm_usable(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """``torch._grouped_mm`` runs this: CUDA of compute capability 9.0 or later (its kernels), bf16,
    and widths whose rows are 16-byte aligned."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return x.shape[-1] % 8 == 0 and w1.shape[1] % 8 == 0


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each row group of ``x`` [R, d] with its expert's weights (dropless)."""
    if grouped_mm_usable(x, w1):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        a = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
        b = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(F.silu(a) * b, w2.transpose(-2, -1), offs=offs)
    return _grouped_swiglu(x, counts, w1, w3, w2)[0]


def capacity(rows: int, n_experts: int, factor: float) -> int:
    """Rows each expert takes at this capacity factor: ``ceil(factor x rows / n_experts)``, at most ``rows``."""
    return min(rows, math.ceil(factor * rows / n_experts))


def capacity_swiglu(
    x: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, cap: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` [R, d] sorted by ``expert`` [R]; each expert's first ``cap`` rows computed in a
    ``[E, cap, d]`` buffer. Returns the output [R, d] (zero for dropped rows) and the kept mask [R]."""
    E = w1.shape[0]
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert]  # the row's place in its expert's group
    kept = slot < cap
    where = expert * cap + slot.clamp(max=cap - 1)
    where = torch.where(kept, where, E * cap)  # dropped rows go to a spare row, never read
    buf = x.new_zeros(E * cap + 1, x.shape[-1]).index_copy(0, where, x)[: E * cap].view(E, cap, -1)
    hidden = F.silu(torch.bmm(buf, w1.transpose(1, 2))) * torch.bmm(buf, w3.transpose(1, 2))
    y = torch.bmm(hidden, w2.transpose(1, 2)).reshape(E * cap, -1)
    y = torch.cat([y, y.new_zeros(1, y.shape[-1])])
    return y[where], kept
