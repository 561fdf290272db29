"""``fp32`` and ``bf16``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import nn


@dataclass
class FP32Options:
    pass


@dataclass
class BF16Options:
    pass


OptionsT = TypeVar("OptionsT")


class FP32(Generic[OptionsT]):
    """Generic in its options type, so that subclasses (``FP8(BF16[FP8Options])``) see their own options."""

    name = "fp32"
    param_dtype: torch.dtype | None = None

    def __init__(self, options: OptionsT) -> None:
        self.options = options

    def supported(self, device: torch.device) -> tuple[bool, str]:
        return True, ""

    def convert(self, model: nn.Module, spec) -> nn.Module:
        return model

    def autocast(self, device: torch.device):
        return contextlib.nullcontext()

    def metrics(self, model: nn.Module) -> dict[str, float]:
        return {}


class BF16(FP32[OptionsT]):
    name = "bf16"
    param_dtype = torch.bfloat16

    def supported(self, device: torch.device) -> tuple[bool, str]:
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return False, f"{torch.cuda.get_device_name(device)} has no bf16"
        return True, ""

    def autocast(self, device: torch.device):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
