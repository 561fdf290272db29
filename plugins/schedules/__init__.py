"""LR schedules: ``warmup_cosine``, ``constant``, ``wsd`` and ``linear``."""

from core.api import hookimpl


@hookimpl
def plait_register(registry):
    from plugins.schedules.schedules import (
        WSD,
        Constant,
        ConstantOptions,
        Linear,
        LinearOptions,
        WarmupCosine,
        WarmupCosineOptions,
        WSDOptions,
    )

    registry.add(
        "lr_schedule",
        "warmup_cosine",
        WarmupCosine,
        options=WarmupCosineOptions,
        doc="linear warmup, then cosine decay to min_lr_ratio x peak at the last step",
    )
    registry.add("lr_schedule", "constant", Constant, options=ConstantOptions, doc="optional linear warmup, then the peak LR")
    registry.add("lr_schedule", "wsd", WSD, options=WSDOptions, doc="warmup, stable at the peak, decay (linear, cosine or 1-sqrt) over the last fraction")
    registry.add("lr_schedule", "linear", Linear, options=LinearOptions, doc="linear warmup, then linear decay to min_lr_ratio x peak")
