"""Throughput and health metrics: MFU, memory, update/parameter ratio, the model's own
metrics reduced over ranks, and the epoch.

MFU = tokens/s per device x FLOPs per token (docs/metrics.md) / the device's
dense bf16 peak from :data:`PEAK_BF16_TFLOPS` (no sparsity). CPUs and unknown
devices report no MFU rather than a guess.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist

from core.protocols import DistInfo, data_tokens_per_epoch, model_step_metrics

# Dense bf16 tensor-core peak, TFLOP/s, from the vendors' data sheets.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("RTX PRO 6000 Blackwell", 503.8),
    ("RTX 6000 Ada", 364.0),
]


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


def mfu(tokens_per_s_per_device: float, flops_per_token: float, device: torch.device) -> float | None:
    peak = peak_flops(device)
    return None if peak is None else tokens_per_s_per_device * flops_per_token / peak


def memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    gib = 2**30
    return {
        "mem_allocated_gib": torch.cuda.memory_allocated(device) / gib,
        "mem_reserved_gib": torch.cuda.memory_reserved(device) / gib,
        "mem_peak_gib": torch.cuda.max_memory_allocated(device) / gib,
    }


class UpdateRatio:
    """||update|| / ||param|| per parameter kind (matrix, embedding, norm, bias), measured on log steps.

    ``before()`` copies the parameters of one log step; ``after()`` compares.
    Sharded (DTensor) parameters give the local shard's ratio, which tracks
    the global one closely for evenly sharded weights.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.saved: list[tuple[str, list[torch.Tensor]]] | None = None

    @staticmethod
    def _local(p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if hasattr(p, "to_local") else p

    @torch.no_grad()
    def before(self) -> None:
        self.saved = [(g.get("name", str(i)), [self._local(p).detach().clone() for p in g["params"]]) for i, g in enumerate(self.optimizer.param_groups)]

    @torch.no_grad()
    def after(self) -> dict[str, float]:
        if self.saved is None:
            return {}
        out = {}
        for (name, old), group in zip(self.saved, self.optimizer.param_groups):
            new = [self._local(p).detach() for p in group["params"]]
            upd = torch.stack([((n.float() - o.float()) ** 2).sum() for n, o in zip(new, old)]).sum().sqrt()
            par = torch.stack([(o.float() ** 2).sum() for o in old]).sum().sqrt()
            out[f"update_ratio/{name}"] = float(upd / par.clamp(min=1e-12))
        self.saved = None
        return out


# -- the model's own metrics, over ranks -------------------------------------------

REDUCTIONS = ("mean", "sum", "max", "min")


def reduce_parts(parts: dict[str, tuple[str, torch.Tensor]], info: DistInfo) -> dict[str, torch.Tensor]:
    """Each ``name: (op, tensor)`` reduced over the ranks with its op (``mean``, ``sum``, ``max``,
    ``min``), in one collective: the tensors are packed into one float64 vector on the device,
    all-gathered, and reduced on the host. Every rank must call it with the same names and shapes.
    Returns CPU float64 tensors of the original shapes (one host sync)."""
    for name, (op, _) in parts.items():
        if op not in REDUCTIONS:
            raise ValueError(f"reduce_parts: {name!r} asks for reduction {op!r}; expected one of {', '.join(REDUCTIONS)}")
    names = list(parts)
    if not names:
        return {}
    flat = torch.cat([parts[n][1].detach().reshape(-1).to(torch.float64) for n in names])
    if info.world_size > 1 and torch_dist.is_initialized():
        gathered = [torch.empty_like(flat) for _ in range(info.world_size)]
        torch_dist.all_gather(gathered, flat)
        table = torch.stack(gathered).cpu()  # [ranks, values]
    else:
        table = flat.cpu()[None]
    out, at = {}, 0
    for n in names:
        op, t = parts[n]
        col = table[:, at : at + t.numel()]
        at += t.numel()
        value = {"mean": lambda c: c.mean(0), "sum": lambda c: c.sum(0), "max": lambda c: c.max(0).values, "min": lambda c: c.min(0).values}[op](col)
        out[n] = value.reshape(t.shape)
    return out


def model_metrics(model: torch.nn.Module, info: DistInfo) -> dict[str, Any]:
    """The built model's own metrics for a log step (loss parts, health), every rank's view
    reduced in one collective (:func:`reduce_parts`) through the model's optional
    ``step_metrics(reduce)``; a model with only ``extra_metrics()`` gives its local view; neither:
    nothing. Every rank must call it on the same steps."""
    step_metrics = model_step_metrics(model)
    if step_metrics is not None:
        return step_metrics(lambda parts: reduce_parts(parts, info))
    from core.protocols import model_extra_metrics

    extra = model_extra_metrics(model)
    return extra() if extra is not None else {}


# -- the epoch -----------------------------------------------------------------------


def epoch(data: Any, tokens_seen: int) -> dict[str, float]:
    """``{"epoch": tokens seen / tokens in one pass over the training data}`` where the data source
    knows its size (its optional ``tokens_per_epoch()``), else ``{}``. 0.5 is half-way through the
    first epoch; the console shows ``Epoch 1`` for it."""
    size = data_tokens_per_epoch(data)
    return {"epoch": tokens_seen / size} if size else {}
