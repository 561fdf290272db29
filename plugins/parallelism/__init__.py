"""Data parallel strategies: ``single``, ``ddp`` and ``fsdp2``."""

from core.api import hookimpl


@hookimpl
def plait_register(registry):
    from plugins.parallelism.ddp import DDP, DDPOptions
    from plugins.parallelism.fsdp2 import FSDP2, FSDP2Options
    from plugins.parallelism.single import Single, SingleOptions

    registry.add("parallelism", "single", Single, options=SingleOptions, doc="one process, no wrapping")
    registry.add(
        "parallelism",
        "ddp",
        DDP,
        options=DDPOptions,
        doc="DistributedDataParallel: a full replica per rank, gradients all-reduced",
    )
    registry.add(
        "parallelism",
        "fsdp2",
        FSDP2,
        options=FSDP2Options,
        doc="FSDP2 fully_shard per block and at the root; bf16 params with fp32 reduction; HSDP via replicate",
    )
