"""The model's own metrics reduced over ranks, and the epoch, for a log step.

MFU, memory and update ratios are monitors (``plugins/monitors``: ``mfu``,
``memory``, ``update_ratio``), which add to a log step's metrics through
the ``plait_metrics`` hook.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist

from core.contract.protocols import DistInfo, data_tokens_per_epoch, model_extra_metrics, model_step_metrics

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
    extra = model_extra_metrics(model)
    return extra() if extra is not None else {}


# -- the epoch -----------------------------------------------------------------------


def epoch(data: Any, tokens_seen: int) -> dict[str, float]:
    """``{"epoch": tokens seen / tokens in one pass over the training data}`` where the data source
    knows its size (its optional ``tokens_per_epoch()``), else ``{}``. 0.5 is half-way through the
    first epoch; the console shows ``Epoch 1`` for it."""
    size = data_tokens_per_epoch(data)
    return {"epoch": tokens_seen / size} if size else {}
