"""Optimizers: ``adamw`` (torch), ``muon`` (Muon on hidden matrices, AdamW on the rest), ``adamw8bit``/``adamw4bit``/``adamw_fp8`` (torchao), ``bnb_adamw8bit`` (bitsandbytes)."""

from core.api import hookimpl


@hookimpl
def plait_register(registry):
    from plugins.optim.adamw import AdamW, AdamWOptions

    registry.add("optimizer", "adamw", AdamW, options=AdamWOptions, doc="torch AdamW, fused or foreach")

    from plugins.optim.muon import Muon, MuonOptions

    registry.add("optimizer", "muon", Muon, options=MuonOptions, doc="Muon on the hidden 2-D matrices, AdamW on embeddings, output head, norms and biases")

    from plugins.optim.lowbit import BnbAdamW8bit, BnbAdamW8bitOptions, TorchaoAdamWOptions, torchao_factory

    for name, what in [("adamw8bit", "8-bit"), ("adamw4bit", "4-bit"), ("adamw_fp8", "fp8")]:
        registry.add("optimizer", name, torchao_factory(name), options=TorchaoAdamWOptions, doc=f"torchao AdamW with {what} optimizer state")
    registry.add(
        "optimizer",
        "bnb_adamw8bit",
        BnbAdamW8bit,
        options=BnbAdamW8bitOptions,
        doc="bitsandbytes 8-bit AdamW, embeddings kept in 32-bit state (extra 'bitsandbytes')",
    )
