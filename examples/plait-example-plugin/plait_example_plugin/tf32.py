"""``tf32``: fp32 weights and activations, with TensorFloat-32 matmuls on NVIDIA GPUs.

A precision plugin says whether it can run here (``supported``), may swap
modules before the model is wrapped (``convert``), gives the context of each
forward pass (``autocast``), the dtype sharded parallelisms compute in
(``param_dtype``) and its own log metrics (``metrics``); see
:class:`core.contract.protocols.Precision`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from core.api import option


@dataclass
class TF32Options:
    matmul_precision: Literal["high", "medium"] = option("high", "torch.set_float32_matmul_precision: 'high' (TF32) or 'medium' (bf16 passes)")


class TF32:
    name = "tf32"
    param_dtype = None  # parameters and gradients stay fp32

    def __init__(self, options: TF32Options) -> None:
        self.options = options

    def supported(self, device: torch.device) -> tuple[bool, str]:
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
            return False, f"{torch.cuda.get_device_name(device)} has no TF32 (needs compute capability 8.0)"
        return True, ""  # on CPU the setting is accepted and changes nothing

    def convert(self, model: nn.Module, spec) -> nn.Module:
        torch.set_float32_matmul_precision(self.options.matmul_precision)
        return model

    def autocast(self, device: torch.device):
        return contextlib.nullcontext()

    def metrics(self, model: nn.Module) -> dict[str, float]:
        return {}
