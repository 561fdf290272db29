"""``mxfp8``: torchao's MXFP8 training (``MXFP8TrainingOpConfig``) on the eligible linears.

Real kernels need Blackwell (compute capability 10.0 or newer). Elsewhere
the ``emulated`` kernel (plain PyTorch quantize/dequantize and matmul) gives
the same numerics slowly; it is allowed only when ``emulate = true`` so that a
fallback chain never picks a slow emulation by accident.

Monitoring: ``mxfp8/weight_amax_max``, ``mxfp8/weight_amax_min``,
``mxfp8/weight_scale_min``, ``mxfp8/linears`` on every log step, and with
``log_step(True)`` (the trainer's call before a log step) ``mxfp8/fwd_amax``
and ``mxfp8/bwd_amax``: the largest input and grad_output magnitudes of the
converted linears over the step (:class:`plugins.precision.fp8.AmaxRecorder`).
MX scales are one power of two per block of 32 values, so no single scale is
logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from core.api import ConfigError, option
from plugins.precision.basic import BF16
from plugins.precision.capability import count_eligible, cuda_capability, kept_high, linear_filter, quiet_torchao_import
from plugins.precision.fp8 import AmaxRecorder, fp8_weight_stats

RECIPES = {
    "rceil": "mxfp8_rceil",
    "rceil_wgrad_with_hp": "mxfp8_rceil_wgrad_with_hp",
}


@dataclass
class MXFP8Options:
    recipe: Literal["rceil", "rceil_wgrad_with_hp"] = option("rceil_wgrad_with_hp", "MXFP8 recipe; *_wgrad_with_hp keeps the weight gradient GEMM in bf16")
    skip: list[str] = option([], "module names (and their children) left in bf16")
    skip_head: bool = option(
        True, "leave the modules the model spec declares high precision (default: the output head, any linear mapping to the vocabulary) in bf16"
    )
    emulate: bool = option(False, "use the emulated kernel where sm100 kernels are missing (slow; CPU tests)")


class MXFP8(BF16[MXFP8Options]):
    name = "mxfp8"

    def __init__(self, options: MXFP8Options) -> None:
        self.options = options
        self.recorder = AmaxRecorder(lambda m: getattr(m, "_plait_lowp", False))
        self.device: torch.device | None = None  # the run's device, as supported() was asked about it

    def check_tensor_parallel(self, tp: int) -> None:
        """Refused: torchao's MXFP8 weight wrapper (``MXFP8TrainingWeightWrapperTensor``) runs its MXFP8 matmul when
        ``F.linear`` sees the wrapper itself; under TP ``F.linear`` sees a DTensor, whose local op reaches the wrapper
        as a plain ``aten.mm``, so the sharded linears would silently run in full precision (measured, torchao 0.18:
        the TP output equals the unconverted linear's bit for bit)."""
        raise ConfigError(
            "[precision] mxfp8 under tensor parallelism is not supported: torchao's MXFP8 training linear (MXFP8TrainingOpConfig) "
            "quantizes only when F.linear sees its weight wrapper, and under TP the weight is a DTensor, so the sharded linears "
            "would silently run unquantized; expected fp8 (any recipe), or bf16"
        )

    def emulated(self) -> bool:
        """Do the MXFP8 GEMMs run through the emulated kernel (no sm100 device) rather than the real ones?
        Decided by the run's device, not the model's: convert() sees the model on the meta device."""
        device = self.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        cc = cuda_capability(device)
        return cc is None or cc < (10, 0)

    def supported(self, device: torch.device) -> tuple[bool, str]:
        quiet_torchao_import("torchao.prototype.moe_training.config", "torchao.quantization")
        try:
            from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig  # noqa: F401
        except ImportError as e:
            return False, f"torchao MXFP8 training is not importable ({e})"
        self.device = device
        cc = cuda_capability(device)
        if cc is not None and cc >= (10, 0):
            return True, ""
        if self.options.emulate:
            return True, ""
        where = "no CUDA device" if cc is None else f"compute capability {cc[0]}.{cc[1]} < 10.0"
        return False, f"{where}: no MXFP8 kernels (set emulate = true for the slow emulated kernel)"

    def check_model(self, model: nn.Module) -> None:
        """Before anything is built (on the meta model): a model with nothing to convert is refused."""
        if count_eligible(model, self.options.skip, 32) == 0:
            raise ConfigError("[precision] mxfp8: the model has no linear layer with dimensions divisible by 32 to convert")

    def convert(self, model: nn.Module, spec) -> nn.Module:
        from torchao.prototype.moe_training.config import KernelPreference, MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_

        self.check_model(model)
        config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(RECIPES[self.options.recipe]))
        import dataclasses

        if self.emulated():
            config = dataclasses.replace(config, kernel_preference=KernelPreference.EMULATED)
        # fp32 master weights: MXFP8 GEMMs dequantize to the weights' dtype (see autocast below)
        config = dataclasses.replace(config, out_dtype=None)
        skip = [*self.options.skip, *kept_high(spec, model, self.options.skip_head)]
        accept = linear_filter(skip, 32)
        for name, module in model.named_modules():
            if accept(module, name):
                module._plait_lowp = True
        quantize_(model, config, filter_fn=lambda m, fqn: accept(m, fqn))
        self.recorder.attach(model)
        return model

    def autocast(self, device: torch.device):
        # The MXFP8 ops quantize their own inputs; with fp32 master weights a
        # bf16 autocast around them would mix bf16 activations and fp32 weights
        # in the high-precision GEMMs, so the remaining ops run in fp32 here.
        import contextlib

        return contextlib.nullcontext()

    def log_step(self, on: bool) -> None:
        """The coming step is a log step (record its forward/backward amax) or not (no hooks)."""
        self.recorder.arm(on)

    def metrics(self, model: nn.Module) -> dict[str, float]:
        weights = {k.replace("fp8/", "mxfp8/"): v for k, v in fp8_weight_stats(model, torch.float8_e4m3fn).items()}
        return {**weights, **self.recorder.read("mxfp8", with_scales=False)}
