"""Whether a state dict about to be saved holds NaN or inf (:class:`NonFiniteState` is raised from
it): a checkpoint is only written from finite parameters and optimizer state."""

from __future__ import annotations

from typing import Any

import torch


class NonFiniteState(RuntimeError):
    """The parameters or optimizer state hold NaN or inf: no checkpoint is written from them."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _float_tensors(state: Any):
    if isinstance(state, torch.Tensor):
        t = _local(state)
        if type(t) is not torch.Tensor and hasattr(t, "dequantize"):  # low-bit optimizer states (torchao)
            t = t.dequantize()
        if t.is_floating_point():
            yield t
    elif isinstance(state, dict):
        for v in state.values():
            yield from _float_tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _float_tensors(v)


def count_nonfinite(state: Any) -> tuple[int, int]:
    """(tensors holding a NaN or inf, floating tensors) in a nested state dict; this rank's shards."""
    tensors = list(_float_tensors(state))
    if not tensors:
        return 0, 0
    flags = []
    for t in tensors:
        try:
            flags.append((~torch.isfinite(t)).any())
        except (NotImplementedError, RuntimeError):  # a tensor subclass without isfinite: not judged
            continue
    return (int(torch.stack(flags).sum()) if flags else 0), len(tensors)
