"""``memory``: the device memory of a log step (CUDA): allocated, reserved and the peak, in GiB.

Adds ``mem_allocated_gib``, ``mem_reserved_gib`` and ``mem_peak_gib`` (the
peak since the run started); adds nothing on a CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from core.api import NoOptions, hookimpl

GIB = 2**30


class Memory:
    def __init__(self, options: NoOptions) -> None:
        pass

    @hookimpl
    def plait_metrics(self, run: Any) -> dict[str, float]:
        device = run.dist.device
        if device.type != "cuda":
            return {}
        return {
            "mem_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "mem_reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "mem_peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
        }
