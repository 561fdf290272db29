"""Routed SwiGLU experts computed on the tokens routed to them only, and split over ranks (expert parallel).

:class:`GroupedExperts` holds a layer's experts as three stacked parameters, ``w1``, ``w3``
``[n_experts, hidden, dim]`` and ``w2`` ``[n_experts, dim, hidden]`` (torchtitan's ``GroupedExperts``):
the sparse path reads them as they are, nothing is stacked per forward. A state dict of the former
layout (``experts.{e}.w1.weight`` ...) loads into it (:meth:`GroupedExperts._load_from_state_dict`).

The router's (token, expert) pairs are sorted by expert (a stable sort: ties keep token order),
so each expert's tokens are one contiguous group of rows. Three ways to run the groups, one result:

* :func:`grouped_swiglu`: dropless; every row goes through its own expert. On CUDA in bf16 with
  16-byte aligned widths it is ``torch._grouped_mm`` (one kernel per projection, as torchtitan's MoE).
  Elsewhere it is the custom op ``plait::grouped_swiglu``: a loop over the experts' row groups with a
  hand-written backward (``torch._grouped_mm`` has no CPU backward in torch 2.13). To dynamo the op
  is one node whose output shape is its input's, so a compiled block has no graph break.
* :func:`capacity_swiglu`: with a capacity factor, each expert takes at most
  ``ceil(factor x routed pairs / n_experts)`` rows (first come, in token order); the rest are dropped
  (that pair adds nothing to the token's output). The rows sit in a fixed ``[n_experts, capacity, dim]``
  buffer: batched matmuls of static shape.
* expert parallel (:meth:`GroupedExperts.shard`): each rank of the ``ep`` group holds
  ``n_experts / ep`` consecutive experts (its parameters are DTensors sharded on dim 0, so a
  checkpoint reshards to any layout). Each rank routes its own tokens, drops what exceeds the
  capacity (the same rows the one-process path drops), sends each row to the rank holding its
  expert with ``all_to_all_single`` (autograd's ``torch.distributed.nn.functional``), runs its experts
  on what it received (:func:`grouped_swiglu`) and sends the outputs back the same way.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.nn.functional as dist_autograd
import torch.nn.functional as F
from torch import nn


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
            rows = x[start : start + n]  # each product written in place (out=): no copies
            a = torch.mm(rows, w1[e].t(), out=h1[start : start + n])
            b = torch.mm(rows, w3[e].t(), out=h3[start : start + n])
            torch.mm(F.silu(a) * b, w2[e].t(), out=out[start : start + n])
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
    dx = torch.empty_like(x)  # every row belongs to an expert: all written below
    dw1, dw3, dw2 = torch.empty_like(w1), torch.empty_like(w3), torch.empty_like(w2)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if not n:
            dw1[e], dw3[e], dw2[e] = 0, 0, 0
            continue
        rows, dy = x[start : start + n], grad[start : start + n]
        a, b = h1[start : start + n], h3[start : start + n]
        sig = torch.sigmoid(a)
        s = a * sig  # silu(a)
        torch.mm(dy.t(), s * b, out=dw2[e])
        dg = dy @ w2[e]
        da = dg * b * (sig * (1 + a * (1 - sig)))  # silu'(a)
        db = dg.mul_(s)
        torch.mm(da.t(), rows, out=dw1[e])
        torch.mm(db.t(), rows, out=dw3[e])
        torch.mm(da, w1[e], out=dx[start : start + n]).addmm_(db, w3[e])
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


def kept_rows(expert: torch.Tensor, counts: torch.Tensor, cap: int) -> torch.Tensor:
    """Of rows sorted by ``expert``, those among their expert's first ``cap`` (what a capacity keeps)."""
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(expert.shape[0], device=expert.device) - starts[expert] < cap


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts ``w2 (silu(w1 x) * w3 x)`` as three stacked parameters.

    :meth:`forward` takes rows sorted by expert; :meth:`one` runs a single expert on any rows (the
    dense path, the collapse probe). After :meth:`shard` the parameters are DTensors holding this
    rank's experts, and :meth:`forward` exchanges rows with the other ranks of the ``ep`` group."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.ep_group: Any = None  # the expert-parallel process group, set by shard()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default: uniform in +-1/sqrt(fan_in) (the model's ``init_weights`` sets its own)."""
        for w in (self.w1, self.w3, self.w2):
            nn.init.uniform_(w, -(w.shape[-1] ** -0.5), w.shape[-1] ** -0.5)

    def shard(self, ep_mesh: Any) -> None:
        """Keep this rank's ``n_experts / ep`` experts (rank r: experts r x n / ep onwards), as DTensors
        sharded on dim 0 over the first dimension of ``ep_mesh`` (``ep``) and replicated over any further
        one (``tp``: every tensor-parallel rank runs the layer whole); no communication (every rank holds
        the same full weights before). DTensor is imported here, by a run that uses it: loading the
        plugins leaves it out (seconds of imports)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        ep, rank = ep_mesh.size(0), ep_mesh.get_local_rank(0)
        per = self.n_experts // ep
        placements = [Shard(0), *[Replicate()] * (ep_mesh.ndim - 1)]
        for name in ("w1", "w3", "w2"):
            full = getattr(self, name).detach()
            local = full[rank * per : (rank + 1) * per].clone()
            setattr(self, name, nn.Parameter(DTensor.from_local(local, ep_mesh, placements, run_check=False)))
        self.ep_group = ep_mesh.get_group(0)

    def local_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's ``w1, w3, w2`` (all of them without expert parallelism) as plain tensors of ``dtype``."""
        ws = (self.w1, self.w3, self.w2)
        if self.ep_group is not None:  # DTensors since shard() (asked of the module, not the tensor: torch.compile traces this)
            ws = tuple(w.to_local() for w in ws)  # type: ignore[attr-defined]
        return tuple(w.to(dtype) for w in ws)  # type: ignore[return-value]

    def one(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on rows ``x`` (every expert is local here: no expert parallelism)."""
        return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])

    def forward(
        self, rows: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor, capacity_factor: float, probe: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Rows [R, d] sorted by ``expert`` [R] (``counts`` [E] each), each through its expert: the
        outputs [R, d], with a capacity factor the kept mask [R] (a dropped row's output is 0), and given
        ``probe`` rows their :meth:`spread` (computed here, where a parallelism that shards the experts
        has gathered them)."""
        w1, w3, w2 = self.local_weights(rows.dtype)
        spread = self.spread(probe) if probe is not None else None
        cap = capacity(rows.shape[0], self.n_experts, capacity_factor) if capacity_factor > 0 else 0
        if self.ep_group is None:
            if cap:
                return *capacity_swiglu(rows, expert, counts, w1, w3, w2, cap), spread
            return grouped_swiglu(rows, counts, w1, w3, w2), None, spread
        if not cap:
            return self.exchanged(rows, counts, w1, w3, w2), None, spread
        kept = kept_rows(expert, counts, cap)
        y = self.exchanged(rows[kept], counts.clamp(max=cap), w1, w3, w2)
        return rows.new_zeros(rows.shape).index_copy(0, kept.nonzero().squeeze(1), y), kept, spread

    @torch.no_grad()
    def spread(self, probe: torch.Tensor) -> torch.Tensor:
        """Std across experts of their outputs on the ``probe`` rows, averaged (0: identical experts). Under
        expert parallelism every rank's probe rows go through every rank's experts (two all_gathers)."""
        group = self.ep_group
        if group is not None:
            ep = tdist.get_world_size(group)
            probes = probe.new_empty(ep * probe.shape[0], probe.shape[1])
            tdist.all_gather_into_tensor(probes, probe.contiguous(), group=group)
            probe = probes
        w1, w3, w2 = self.local_weights(probe.dtype)
        outs = torch.bmm(F.silu(torch.einsum("rd,ehd->erh", probe, w1)) * torch.einsum("rd,ehd->erh", probe, w3), w2.transpose(1, 2))
        if group is not None:
            every = outs.new_empty(ep * outs.shape[0], *outs.shape[1:])
            tdist.all_gather_into_tensor(every, outs.contiguous(), group=group)
            outs = every
        return outs.float().std(0).mean() if outs.shape[0] > 1 else probe.new_zeros((), dtype=torch.float32)

    def exchanged(self, rows: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Expert parallel: each row sent to the rank holding its expert, computed there, sent back."""
        group = self.ep_group
        ep = tdist.get_world_size(group)
        per = self.n_experts // ep
        got = torch.empty_like(counts)
        tdist.all_to_all_single(got, counts, group=group)  # [source rank, my expert]: rows each source sends
        send = counts.view(ep, per).sum(1).tolist()
        recv_counts = got.view(ep, per)
        recv = recv_counts.sum(1).tolist()
        received = dist_autograd.all_to_all_single(rows.new_empty(sum(recv), rows.shape[1]), rows, recv, send, group=group)
        # source-major, expert-minor: regroup by expert (stable: each source's rows in order)
        local = torch.arange(per, device=rows.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
        order = local.argsort(stable=True)
        y = grouped_swiglu(received[order], recv_counts.sum(0), w1, w3, w2)
        back = y.new_empty(y.shape).index_copy(0, order, y)  # in the order received
        return dist_autograd.all_to_all_single(rows.new_empty(rows.shape), back, send, recv, group=group)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """A state dict of the per-expert layout (``{prefix}{e}.w1.weight`` ...) is stacked into this one."""
        for name in ("w1", "w3", "w2"):
            old = [f"{prefix}{e}.{name}.weight" for e in range(self.n_experts)]
            if f"{prefix}{name}" not in state_dict and all(k in state_dict for k in old):
                state_dict[f"{prefix}{name}"] = torch.stack([state_dict.pop(k) for k in old])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
