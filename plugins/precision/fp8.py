"""``fp8``: torchao float8 training (tensorwise, rowwise, rowwise_with_gw_hp) on the eligible linears.

Linears whose dimensions divide by 16 become ``Float8Linear``; everything
else runs under bf16 autocast, as in torchtitan. What the model spec declares high precision (by default the output head: any linear
that maps to the vocabulary, whatever the model names it) is skipped by
default (its error matters most). On CUDA it needs compute capability 8.9
(Ada, Hopper) or newer. On CPU (``allow_cpu = true``, for tests and debugging) every
recipe runs through torchao's emulation (``Float8LinearConfig.emulate``: the operands cast to
float8 with the recipe's scales, then multiplied in fp32), as ``mxfp8`` does with ``emulate``: the
recipe's numerics at about 3 times fp32's time per linear, where torch's CPU ``_scaled_mm`` is a
scalar reference (about 1000 times: minutes a step). :meth:`FP8.emulated` says which a run uses; ``core.plan`` and ``core.train`` print it.

Monitoring: weight amax and scale on every log step; with ``log_step(True)``
before a log step (the trainer's call) also the forward (inputs) and backward
(grad_output) amax of the float8 linears over that step's micro-batches and
the scales torchao derived from them (:class:`AmaxRecorder`). torchao scales
dynamically and keeps no scale, so light hooks record the amax; they are
installed for log steps only and removed after, so other steps do no extra
work (under ``torch.compile`` a log step's hooks run eagerly: a graph break
on log steps only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from core.api import ConfigError, log, option
from plugins.precision.basic import BF16
from plugins.precision.capability import count_eligible, cuda_capability, kept_high, linear_filter, quiet_torchao_import

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass
class FP8Options:
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = option("tensorwise", "torchao float8 scaling recipe")
    skip: list[str] = option([], "module names (and their children) left in bf16")
    skip_head: bool = option(
        True, "leave the modules the model spec declares high precision (default: the output head, any linear mapping to the vocabulary) in bf16"
    )
    pad_inner_dim: bool = option(False, "pad GEMM inner dimensions to multiples of 16 instead of requiring them")
    fsdp_float8_all_gather: bool = option(True, "tensorwise + fsdp2 on CUDA: all-gather weights in float8 (with scale precompute)")
    allow_cpu: bool = option(False, "run on CPU (torchao's emulated float8 matmuls, a few times fp32's time; for tests)")
    small_gemm_filter: bool = option(True, "on CUDA, leave linears too small for fp8 to gain in bf16 (torchao's per-recipe size thresholds, from H100 timings)")


class FP8(BF16[FP8Options]):
    name = "fp8"

    def __init__(self, options: FP8Options) -> None:
        self.options = options
        self._fsdp_all_gather = False
        self.device: torch.device | None = None  # the run's device, as supported() was asked about it
        self.recorder = AmaxRecorder(is_float8_linear)

    def emulated(self) -> bool:
        """Do the float8 matmuls run through torchao's emulation (off CUDA) rather than ``torch._scaled_mm``?"""
        device = self.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return cuda_capability(device) is None

    def supported(self, device: torch.device) -> tuple[bool, str]:
        quiet_torchao_import()
        try:
            import torchao.float8  # noqa: F401
        except ImportError as e:
            return False, f"torchao.float8 is not importable ({e})"
        self.device = device
        cc = cuda_capability(device)
        if cc is None:
            if not self.options.allow_cpu:
                return False, "no CUDA device (set allow_cpu = true to run on CPU)"
            log.note(
                f"fp8 {self.options.recipe} on {device.type}: torchao's emulated float8 matmuls (operands cast to float8, "
                "multiplied in fp32; a few times fp32's time); torch._scaled_mm kernels run on CUDA only"
            )
            return True, ""
        if cc < (8, 9):
            return False, f"compute capability {cc[0]}.{cc[1]} < 8.9 has no fp8 tensor cores"
        return True, ""

    def check_model(self, model: nn.Module) -> None:
        multiple = 1 if self.options.pad_inner_dim else 16
        if count_eligible(model, self.options.skip, multiple) == 0:
            raise ConfigError(f"[precision] {self.name}: the model has no linear layer with dimensions divisible by 16 to convert")

    def convert(self, model: nn.Module, spec) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        self.check_model(model)
        config = Float8LinearConfig.from_recipe_name(self.options.recipe)
        if self.options.pad_inner_dim:
            config = _replace(config, pad_inner_dim=True)
        if self.emulated():  # torch's CPU _scaled_mm is a scalar reference: minutes a step
            config = _replace(config, emulate=True)
        on_cuda = torch.cuda.is_available()
        if self.options.recipe == "tensorwise" and self.options.fsdp_float8_all_gather and on_cuda:
            config = _replace(config, enable_fsdp_float8_all_gather=True)
            self._fsdp_all_gather = True
        multiple = 1 if self.options.pad_inner_dim else 16
        skip = [*self.options.skip, *kept_high(spec, model, self.options.skip_head)]
        accept = linear_filter(skip, multiple)
        if self.options.small_gemm_filter and on_cuda and self.options.recipe in ("tensorwise", "rowwise"):
            accept = with_size_filter(accept, self.options.recipe)
        eligible = count_eligible(model, skip, multiple)
        converted = sum(accept(m, name) for name, m in model.named_modules())
        (log.warn if converted == 0 else log.note)(
            f"fp8 {self.options.recipe}: {converted} of {eligible} eligible linears in float8"
            + (f" ({eligible - converted} too small to gain stay in bf16)" if converted < eligible else "")
        )
        model = convert_to_float8_training(model, config=config, module_filter_fn=accept)
        self.recorder.attach(model)
        return model

    def autocast(self, device: torch.device):
        # rowwise_with_gw_hp computes the weight gradient in the weights' own
        # dtype; with fp32 master weights under bf16 autocast torchao would mix
        # bf16 and fp32 there, so this recipe keeps the non-fp8 ops in fp32.
        # (Under fsdp2's bf16 parameters the dtypes agree anyway.)
        if self.options.recipe == "rowwise_with_gw_hp":
            import contextlib

            return contextlib.nullcontext()
        return super().autocast(device)

    def post_optimizer_step(self, model: nn.Module) -> None:
        """With float8 all-gather under fsdp2, compute next step's weight scales in one go."""
        if self._fsdp_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)

    def log_step(self, on: bool) -> None:
        """The coming step is a log step (record its forward/backward amax) or not (no hooks)."""
        self.recorder.arm(on)

    def metrics(self, model: nn.Module) -> dict[str, float]:
        return {**fp8_weight_stats(model, torch.float8_e4m3fn), **self.recorder.read("fp8", with_scales=True)}


def is_float8_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


class AmaxRecorder:
    """Largest |input| (forward) and |grad_output| (backward) of the low-precision linears over one step.

    ``arm(True)`` installs a forward pre-hook (the input, cast to the autocast dtype as
    ``Float8Linear`` does) and a forward hook that hooks the output's gradient on every selected
    linear; ``arm(False)`` removes them. Each hook keeps a running ``torch.maximum`` on the device
    (no host sync). :meth:`read` reduces over ranks (max, one all-reduce when a process group is up)
    and returns the amax and the scale torchao derives from it with its own ``amax_to_scale``
    (the largest representable value of the cast's dtype over the amax, rounded down to a power of
    two where the recipe says so): for tensorwise the scale of the step's most extreme tensor, for
    rowwise the smallest row scale. Every rank must call :meth:`read` on the same steps.
    """

    def __init__(self, select) -> None:
        self.select = select
        self.modules: list[nn.Module] = []
        self.handles: list = []
        self.fwd: torch.Tensor | None = None
        self.bwd: torch.Tensor | None = None

    def attach(self, model: nn.Module) -> None:
        self.arm(False)
        self.modules = [m for m in model.modules() if self.select(m)]
        self.fwd = self.bwd = None

    def arm(self, on: bool) -> None:
        if not on:
            for h in self.handles:
                h.remove()
            self.handles = []
            return
        if self.handles:
            return
        self.fwd = self.bwd = None
        # eager under torch.compile; wrapped here, not with a decorator, so that importing the plugin
        # does not import torch._dynamo (a second of every process's start)
        on_input, on_output = torch.compiler.disable(self._on_input), torch.compiler.disable(self._on_output)
        for m in self.modules:
            self.handles.append(m.register_forward_pre_hook(on_input))
            self.handles.append(m.register_forward_hook(on_output))

    @staticmethod
    def _amax(t: torch.Tensor) -> torch.Tensor:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.detach().abs().max().float()

    def _on_input(self, module, args) -> None:
        x = args[0]
        if torch.is_autocast_enabled():
            x = x.to(torch.get_autocast_gpu_dtype())  # what Float8Linear quantizes
        a = self._amax(x)
        self.fwd = a if self.fwd is None else torch.maximum(self.fwd, a)

    def _on_output(self, module, args, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        a = self._amax(grad)
        self.bwd = a if self.bwd is None else torch.maximum(self.bwd, a)

    def read(self, prefix: str, with_scales: bool) -> dict[str, float]:
        """``<prefix>/fwd_amax``, ``<prefix>/bwd_amax`` (and ``_scale`` with ``with_scales``) of the
        recorded step, then forgets it; ``{}`` when nothing was recorded."""
        import torch.distributed as dist

        if self.fwd is None or not self.modules:
            return {}
        fwd = self.fwd
        bwd = self.bwd if self.bwd is not None else torch.full_like(fwd, -1.0)  # -1: no backward recorded
        both = torch.stack([fwd, bwd])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
        self.fwd = self.bwd = None
        fwd_amax, bwd_amax = (float(v) for v in both.tolist())
        out = {f"{prefix}/fwd_amax": fwd_amax}
        if bwd_amax >= 0:
            out[f"{prefix}/bwd_amax"] = bwd_amax
        if with_scales:
            from torchao.float8.float8_utils import amax_to_scale

            c: Any = self.modules[0].config  # torchao's Float8LinearConfig, a plain attribute
            rnd = c.round_scales_to_power_of_2
            out[f"{prefix}/fwd_scale"] = float(amax_to_scale(both[0:1], c.cast_config_input.target_dtype, rnd)[0])
            if f"{prefix}/bwd_amax" in out:
                out[f"{prefix}/bwd_scale"] = float(amax_to_scale(both[1:2], c.cast_config_grad_output.target_dtype, rnd)[0])
        return out


def with_size_filter(accept, recipe: str):
    """``accept`` and torchao's small-GEMM filter for ``recipe``: a linear whose matmuls are too small
    for float8 to beat bf16 (its quantization overhead dominates) stays in bf16."""
    try:
        from torchao.float8 import _auto_filter_for_recipe  # experimental in torchao; absent in old releases
    except ImportError:
        return accept
    too_small = _auto_filter_for_recipe(recipe, filter_fqns=[])
    return lambda module, fqn: accept(module, fqn) and too_small(module, fqn)


def _replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


@torch.no_grad()
def fp8_weight_stats(model: nn.Module, dtype: torch.dtype) -> dict[str, float]:
    """Health of low-precision linears: weight amax and the implied scale (max representable / amax)."""
    amaxes = []
    for module in model.modules():
        if type(module).__name__ in ("Float8Linear", "MXLinear") or getattr(module, "_plait_lowp", False):
            w = cast(torch.Tensor, module.weight)
            w = w.full_tensor() if hasattr(w, "full_tensor") else w
            amaxes.append(w.detach().abs().max().float())
    if not amaxes:
        return {}
    a = torch.stack(amaxes)
    fmax = torch.finfo(dtype).max
    return {
        "fp8/weight_amax_max": float(a.max()),
        "fp8/weight_amax_min": float(a.min()),
        "fp8/weight_scale_min": float(fmax / a.max().clamp(min=1e-12)),
        "fp8/linears": float(len(amaxes)),
    }
