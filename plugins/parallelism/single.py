"""``single``: one process, the model as it is."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from core.api import ConfigError
from plugins.parallelism.common import clip_grad_norm


@dataclass
class SingleOptions:
    pass


class Single:
    shards_parameters = False

    def __init__(self, options: SingleOptions) -> None:
        self.options = options

    def check_world(self, world_size: int) -> None:
        if world_size != 1:
            raise ConfigError(f"[parallelism] 'single' runs on one process, not {world_size}; use 'ddp' or 'fsdp2'")

    def wrap(self, model: nn.Module, spec, dist, precision) -> nn.Module:
        return model

    def sync_context(self, model: nn.Module, sync: bool):
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(model, max_norm)
