"""Low-memory AdamW variants: torchao's 8-bit, 4-bit and fp8 states, and bitsandbytes' 8-bit.

All of them take the core's parameter groups (no decay on norms, biases and
embeddings; per-kind LR multipliers), like ``adamw``. The libraries are
imported when the optimizer is built, so a missing one is this plugin's
error alone.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from core.api import OptimizerOptions, PluginError, option

TORCHAO_CLASSES = {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit", "adamw_fp8": "AdamWFp8"}
STATE_BYTES = {"adamw8bit": 2.0, "adamw4bit": 1.0, "adamw_fp8": 2.0}


@dataclass
class TorchaoAdamWOptions(OptimizerOptions):
    betas: tuple[float, float] = option((0.9, 0.95), "Adam's (beta1, beta2)", ge=0, lt=1)
    eps: float = option(1e-8, "Adam's epsilon; 0 would make the update of a zero gradient 0/0 = NaN", gt=0)
    block_size: int = option(256, "elements per quantization block of the optimizer state (adamw4bit: 128 is torchao's default)", gt=0)
    bf16_stochastic_round: bool = option(False, "stochastic rounding when parameters are bf16")


class TorchaoAdamW:
    """``adamw8bit`` / ``adamw4bit`` / ``adamw_fp8`` from ``torchao.optim``."""

    def __init__(self, name: str, options: TorchaoAdamWOptions) -> None:
        self.name = name
        self.options = options
        self.state_bytes_per_param = STATE_BYTES[name]

    def build(self, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        from plugins.precision.capability import quiet_torchao_import

        quiet_torchao_import("torchao.optim")
        try:
            import torchao.optim as ao
        except ImportError as e:
            raise PluginError(f"optimizer {self.name!r} needs torchao.optim: {e}") from None
        # torch's compile cache asks every tensor subclass for a stable hash that torchao's optimizer
        # states lack; it warns once per run and hashes their flattened form instead (nothing to act on)
        warnings.filterwarnings("ignore", message=r"OptimState\w+ does not implement _stable_hash_for_caching")
        o = self.options
        cls = getattr(ao, TORCHAO_CLASSES[self.name])
        return cls(
            param_groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, block_size=o.block_size, bf16_stochastic_round=o.bf16_stochastic_round
        )


def torchao_factory(name: str):
    return lambda options: TorchaoAdamW(name, options)


@dataclass
class BnbAdamW8bitOptions(OptimizerOptions):
    betas: tuple[float, float] = option((0.9, 0.95), "Adam's (beta1, beta2)", ge=0, lt=1)
    eps: float = option(1e-8, "Adam's epsilon; 0 would make the update of a zero gradient 0/0 = NaN", gt=0)
    stable_embedding: bool = option(True, "keep embedding optimizer state in 32 bits (bitsandbytes' StableEmbedding recipe)")
    min_8bit_size: int = option(4096, "tensors with fewer elements keep 32-bit state", ge=0)


class BnbAdamW8bit:
    """``bnb_adamw8bit``: bitsandbytes' 8-bit AdamW (extra ``bitsandbytes``)."""

    state_bytes_per_param = 2.0

    def __init__(self, options: BnbAdamW8bitOptions) -> None:
        self.options = options

    def build(self, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise PluginError(f"optimizer 'bnb_adamw8bit' needs bitsandbytes (pip install 'plait[bitsandbytes]'): {e}") from None
        o = self.options
        opt = bnb.optim.AdamW8bit(param_groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, min_8bit_size=o.min_8bit_size)
        if o.stable_embedding:
            # StableEmbedding's optimizer half: 32-bit state for the embedding matrix.
            manager = bnb.optim.GlobalOptimManager.get_instance()
            for group in param_groups:
                if group.get("name") == "embedding":
                    for p in group["params"]:
                        manager.override_config(p, "optim_bits", 32)
        return opt
