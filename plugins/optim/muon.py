"""``muon``: Muon on the hidden 2-D matrices, AdamW on embeddings, the output head, norms and biases.

One ``torch.optim.Optimizer`` (:class:`MuonAdamW`) holds both, so the checkpoint saves and
reshards its state like any other optimizer's. The groups it makes from the core's kinds:

* ``matrix`` (2-D): Muon, ``lr`` and ``weight_decay``. The update is the Nesterov momentum
  of the gradient, orthogonalized by ``ns_steps`` Newton-Schulz iterations (in ``ns_dtype``:
  ``auto`` is bfloat16 on CUDA as torch.optim.Muon, float32 elsewhere, 25x faster on this CPU),
  then scaled by the shape-based LR adjustment ``adjust_lr`` (torch.optim.Muon's two rules, for a
  matrix of ``A x B`` = out x in features):
  ``"original"`` (Keller Jordan's): ``lr x sqrt(max(1, A / B))``;
  ``"match_rms_adamw"`` (Moonshot's): ``lr x 0.2 x sqrt(max(A, B))``, an update of AdamW's RMS,
  so AdamW's LR and weight decay carry over. Weight decay is decoupled: ``p -= lr x wd x p``.
  A ``matrix`` parameter that is not 2-D goes to AdamW.
* ``embedding``, ``output`` (the untied head: the optimizer sets ``separate_output_head``),
  ``norm``, ``bias``: AdamW (torch's functional AdamW, the same arithmetic as ``adamw``) with
  ``adamw_lr``, ``adamw_betas``, ``adamw_eps`` and ``adamw_weight_decay`` (none for the kinds
  in ``no_decay``).

``lr_multipliers`` scale each kind's LR as for every optimizer; the schedule scales every group.
Under µP (``mup_matrix_lr_power``) the matrices keep Muon's LR with ``original`` (the spectral rule
is width-independent) and take sqrt(base_width / width) with ``match_rms_adamw``.
Under fsdp2 and HSDP a Muon parameter is a DTensor sharded on dim 0: each rank all-gathers the
momentum-updated matrix over its shard group (one all-gather per matrix, the bytes of FSDP's own
parameter gather), runs Newton-Schulz on the whole matrix and keeps its own rows. Every rank does
the same arithmetic on the same matrix, so the update equals ddp's up to the reduction order of
the gradients (tests/e2e/test_muon.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from core.api import OptimizerOptions, option

KINDS = ("matrix", "embedding", "norm", "bias", "output")
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, torch.optim.Muon's default
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class MuonOptions(OptimizerOptions):
    lr: float = option(0.02, "Muon's peak LR for the hidden matrices (the schedule multiplies it; see adjust_lr)", gt=0)
    weight_decay: float = option(0.0, "Muon's decoupled weight decay on the hidden matrices (p -= lr x weight_decay x p)", ge=0)
    no_decay: list[str] = option(["embedding", "norm", "bias"], "parameter kinds without weight decay (matrix, embedding, norm, bias, output)")
    lr_multipliers: dict[str, float] = option({}, "LR multiplier per parameter kind (matrix, embedding, norm, bias, output)", ge=0)
    momentum: float = option(0.95, "Muon's momentum", ge=0, lt=1)
    nesterov: bool = option(True, "Nesterov momentum (the update is grad + momentum x buffer, lerped)")
    ns_steps: int = option(5, "Newton-Schulz iterations of the orthogonalization", ge=1, le=99)
    ns_coefficients: tuple[float, float, float] = option(NS_COEFFICIENTS, "(a, b, c) of the quintic Newton-Schulz iteration")
    ns_eps: float = option(1e-7, "floor of the norm the matrix is divided by before Newton-Schulz", gt=0)
    ns_dtype: Literal["auto", "bfloat16", "float32"] = option(
        "auto", "dtype of the Newton-Schulz iteration: auto is bfloat16 on CUDA (torch.optim.Muon's), float32 elsewhere (CPU bf16 matmuls are slow)"
    )
    adjust_lr: Literal["original", "match_rms_adamw"] = option(
        "original", "shape-based LR of a matrix A x B: original lr x sqrt(max(1, A/B)); match_rms_adamw lr x 0.2 x sqrt(max(A, B))"
    )
    adamw_lr: float = option(3e-4, "AdamW's peak LR for embeddings, output head, norms and biases", gt=0)
    adamw_weight_decay: float = option(0.1, "AdamW's decoupled weight decay for those of its kinds not in no_decay", ge=0)
    adamw_betas: tuple[float, float] = option((0.9, 0.95), "AdamW's (beta1, beta2)", ge=0, lt=1)
    adamw_eps: float = option(1e-8, "AdamW's epsilon", gt=0)

    def check(self) -> None:
        for kind in list(self.no_decay) + list(self.lr_multipliers):
            if kind not in KINDS:
                raise ValueError(f"unknown parameter kind {kind!r}; kinds: {', '.join(KINDS)}")
        if len(self.ns_coefficients) != 3 or not all(math.isfinite(c) for c in self.ns_coefficients):
            raise ValueError(f"ns_coefficients must be three finite numbers (a, b, c), got {list(self.ns_coefficients)}")


class Muon:
    """The ``muon`` optimizer plugin."""

    state_bytes_per_param = 8  # at most: AdamW's two fp32 moments; a Muon matrix keeps one (4)
    separate_output_head = True  # the untied head is AdamW's, not Muon's

    def __init__(self, options: MuonOptions) -> None:
        self.options = options

    @property
    def mup_matrix_lr_power(self) -> float:
        """µP's rule for the hidden matrices (core.contract.mup): ``original`` scales an orthogonalized
        update to spectral norm lr x sqrt(max(1, A/B)), already width-independent for matrices whose
        shapes grow together (0: no multiplier); ``match_rms_adamw``'s 0.2 sqrt(max(A, B)) grows as
        sqrt(width), so the LR takes sqrt(base_width / width) (0.5)."""
        return 0.0 if self.options.adjust_lr == "original" else 0.5

    def build(self, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return MuonAdamW(split_groups(param_groups, self.options))


def split_groups(param_groups: list[dict[str, Any]], o: MuonOptions) -> list[dict[str, Any]]:
    """The core's groups as Muon and AdamW groups, in the core's order (the first group's LR is the logged one)."""
    muon = {"algorithm": "muon", "momentum": o.momentum, "nesterov": o.nesterov, "ns_steps": o.ns_steps}
    muon |= {"ns_coefficients": tuple(o.ns_coefficients), "eps": o.ns_eps, "ns_dtype": o.ns_dtype, "adjust_lr": o.adjust_lr}
    adamw = {"algorithm": "adamw", "betas": tuple(o.adamw_betas), "eps": o.adamw_eps}
    out = []
    for g in param_groups:
        mult, kind = g["lr_mult"], g["name"]
        matrices = [p for p in g["params"] if p.ndim == 2] if kind == "matrix" else []
        others = [p for p in g["params"] if kind != "matrix" or p.ndim != 2]
        if matrices:
            out.append({**g, **muon, "params": matrices, "lr": o.lr * mult, "weight_decay": 0.0 if kind in o.no_decay else o.weight_decay})
        if others:
            name = kind if kind != "matrix" else "matrix_not_2d"
            decay = 0.0 if kind in o.no_decay else o.adamw_weight_decay
            out.append({**g, **adamw, "params": others, "name": name, "lr": o.adamw_lr * mult, "weight_decay": decay})
    return out


class MuonAdamW(torch.optim.Optimizer):
    """Muon groups (``algorithm = "muon"``, state ``momentum_buffer``) and AdamW groups
    (``algorithm = "adamw"``, state ``step``, ``exp_avg``, ``exp_avg_sq`` as torch's AdamW)."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, wd, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            ortho = orthogonalized(update, group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"])
            p.mul_(1 - lr * wd)
            p.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr"], p.shape))

    def _adamw_step(self, group: dict[str, Any]) -> None:
        from torch.optim.adam import adam

        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def adjusted_lr(lr: float, rule: str, shape: torch.Size) -> float:
    """The shape-based LR of a matrix ``A x B`` (torch.optim.Muon's ``adjust_lr_fn``)."""
    a, b = shape[0], shape[1]
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    return lr * math.sqrt(max(1.0, a / b))


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, ns_dtype: str) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards the orthogonal factor of ``g`` (2-D), as torch.optim.Muon runs it,
    in ``ns_dtype`` (``auto``: bfloat16 on CUDA, float32 elsewhere); the result in ``g``'s dtype."""
    a, b, c = coefficients
    auto = torch.bfloat16 if g.device.type == "cuda" else torch.float32
    x = g.to(auto if ns_dtype == "auto" else DTYPES[ns_dtype])
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(g.dtype)


def orthogonalized(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, ns_dtype: str) -> torch.Tensor:
    """Newton-Schulz of the whole matrix. A DTensor (fsdp2, HSDP) is all-gathered over its mesh
    (on the mesh's device: a CPU-offloaded shard travels there and back), and each rank keeps
    its own shard of the result, placed as ``update`` is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(update, DTensor):
        return newton_schulz(update, coefficients, steps, eps, ns_dtype)
    mesh, placements = update.device_mesh, update.placements
    local = update.to_local()
    home = local.device
    on_mesh = DTensor.from_local(local.to(mesh.device_type), mesh, placements, shape=update.shape, stride=update.stride())
    whole = newton_schulz(on_mesh.full_tensor(), coefficients, steps, eps, ns_dtype)
    mine = distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()
    return DTensor.from_local(mine.to(home), mesh, placements, shape=update.shape, stride=update.stride())
