"""``te_fp8``: NVIDIA Transformer Engine FP8 with delayed scaling.

Eligible ``nn.Linear`` layers become ``transformer_engine.pytorch.Linear``
(weights copied), and each forward runs under ``fp8_autocast`` with a
``DelayedScaling`` recipe. Needs the ``te`` extra, CUDA and compute
capability 8.9 or newer; elsewhere it reports itself unsupported with the
reason, so a fallback chain moves on.

Monitoring (as the FP8-on-H200 document logs them): ``fp8/fwd_scale`` and
``fp8/bwd_scale``, the smallest scale over the forward (input, weight) and
backward (grad_output) tensors of the TE linears, and ``fp8/fwd_amax``,
``fp8/bwd_amax``, the largest most recent amax, read from each module's
``fp8_meta["scaling_fwd" | "scaling_bwd"]`` (``scale``, ``amax_history``; row 0
is the latest step) of delayed scaling. Written from Transformer Engine's
documented API; untested here (TE needs CUDA and is not installable on the
CPU machines plait's tests run on).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from core.api import ConfigError, option
from plugins.precision.basic import BF16
from plugins.precision.capability import cuda_capability, kept_high, linear_filter


@dataclass
class TEFP8Options:
    format: Literal["hybrid", "e4m3"] = option("hybrid", "hybrid: E4M3 forward, E5M2 backward; e4m3: both")
    margin: int = option(0, "scaling-factor margin (powers of two of headroom)", ge=0)
    amax_history_len: int = option(1024, "steps of amax history for delayed scaling", gt=0)
    amax_compute_algo: Literal["max", "most_recent"] = option("max", "how the scale is taken from the amax history")
    skip: list[str] = option([], "module names left in bf16")
    skip_head: bool = option(
        True, "leave the modules the model spec declares high precision (default: the output head, any linear mapping to the vocabulary) in bf16"
    )


class TEFP8(BF16[TEFP8Options]):
    name = "te_fp8"

    def __init__(self, options: TEFP8Options) -> None:
        self.options = options
        self._recipe = None

    def check_tensor_parallel(self, tp: int) -> None:
        raise ConfigError(
            "[precision] te_fp8 under tensor parallelism is not supported (the model plans shard torch linears, not Transformer Engine's); "
            'expected fp8 with recipe = "tensorwise", or bf16'
        )

    def supported(self, device: torch.device) -> tuple[bool, str]:
        try:
            import transformer_engine.pytorch  # noqa: F401
        except ImportError as e:
            return False, f"transformer_engine is not installed ({e}); pip install 'plait[te]'"
        cc = cuda_capability(device)
        if cc is None:
            return False, "Transformer Engine needs a CUDA device"
        if cc < (8, 9):
            return False, f"compute capability {cc[0]}.{cc[1]} < 8.9 has no fp8 tensor cores"
        return True, ""

    def convert(self, model: nn.Module, spec) -> nn.Module:
        import transformer_engine.pytorch as te

        skip = [*self.options.skip, *kept_high(spec, model, self.options.skip_head)]
        accept = linear_filter(skip, 16)
        for name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                fqn = f"{name}.{child_name}" if name else child_name
                if accept(child, fqn):
                    new = te.Linear(child.in_features, child.out_features, bias=child.bias is not None, device=child.weight.device)
                    module.register_module(child_name, new)
        return model

    def recipe(self):
        if self._recipe is None:
            from transformer_engine.common.recipe import DelayedScaling, Format

            o = self.options
            self._recipe = DelayedScaling(
                fp8_format=Format.HYBRID if o.format == "hybrid" else Format.E4M3,
                margin=o.margin,
                amax_history_len=o.amax_history_len,
                amax_compute_algo=o.amax_compute_algo,
            )
        return self._recipe

    def autocast(self, device: torch.device):
        import transformer_engine.pytorch as te

        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device_type=device.type, dtype=torch.bfloat16))
        stack.enter_context(te.fp8_autocast(enabled=True, fp8_recipe=self.recipe()))
        return stack

    def metrics(self, model: nn.Module) -> dict[str, float]:
        return te_scale_stats(model)


@torch.no_grad()
def te_scale_stats(model: nn.Module) -> dict[str, float]:
    """Delayed-scaling state of every TE module: smallest scale and largest latest amax, forward and backward."""
    found: dict[str, tuple[list, list]] = {"fwd": ([], []), "bwd": ([], [])}
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        if not isinstance(meta, dict):
            continue
        for way in ("fwd", "bwd"):
            state = meta.get(f"scaling_{way}")
            if state is None:
                continue
            scales, amaxes = found[way]
            if getattr(state, "scale", None) is not None:
                scales.append(state.scale.float().min())
            history = getattr(state, "amax_history", None)
            if history is not None and history.numel():
                amaxes.append(history[0].float().max())
    out = {}
    for way, (scales, amaxes) in found.items():
        if scales:
            out[f"fp8/{way}_scale"] = float(torch.stack(scales).min())
        if amaxes:
            out[f"fp8/{way}_amax"] = float(torch.stack(amaxes).max())
    return out
