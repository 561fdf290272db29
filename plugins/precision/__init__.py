"""Numeric formats: ``fp32``, ``bf16``, ``fp8`` and ``mxfp8`` (torchao), ``te_fp8`` (Transformer Engine)."""

from core.api import hookimpl


@hookimpl
def plait_register(registry):
    from plugins.precision.basic import BF16, FP32, BF16Options, FP32Options

    registry.add("precision", "fp32", FP32, options=FP32Options, doc="full fp32 forward and backward")
    registry.add(
        "precision",
        "bf16",
        BF16,
        options=BF16Options,
        doc="bf16 autocast over fp32 master weights (fsdp2: bf16 params, fp32 grad reduction)",
    )
    from plugins.precision.fp8 import FP8, FP8Options
    from plugins.precision.mxfp8 import MXFP8, MXFP8Options
    from plugins.precision.te_fp8 import TEFP8, TEFP8Options

    registry.add("precision", "fp8", FP8, options=FP8Options, doc="torchao float8 training linears (sm89+; CPU with allow_cpu)")
    registry.add("precision", "mxfp8", MXFP8, options=MXFP8Options, doc="torchao MXFP8 training linears (sm100+; emulated elsewhere)")
    registry.add("precision", "te_fp8", TEFP8, options=TEFP8Options, doc="Transformer Engine fp8 with delayed scaling (extra 'te', sm89+)")
