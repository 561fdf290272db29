"""The ``recurrent_moe`` model spec plugin: a looped mixture-of-experts transformer."""

from core.api import hookimpl


@hookimpl
def plait_register(registry):
    from model_specs.recurrent_moe.spec import RecurrentMoEOptions, RecurrentMoESpec

    registry.add(
        "model",
        "recurrent_moe",
        RecurrentMoESpec.from_options,
        options=RecurrentMoEOptions,
        doc="looped MoE transformer: prelude, a core applied n_loops times, coda; top-k experts, balance and z losses",
    )
