"""The ``llama3`` model plugin: a Llama-3 style decoder (see :mod:`model_specs.llama3.model`)."""

from core.api import hookimpl
from model_specs.llama3.spec import FLAVORS, Llama3Options, Llama3Spec

__all__ = ["FLAVORS", "Llama3Options", "Llama3Spec", "plait_register"]


@hookimpl
def plait_register(registry):
    registry.add(
        "model",
        "llama3",
        Llama3Spec.from_options,
        options=Llama3Options,
        doc="Llama-3 style decoder: RMSNorm, SwiGLU, GQA, RoPE, causal SDPA",
    )
