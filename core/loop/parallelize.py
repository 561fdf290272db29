"""Turning a built model into the one that trains, in a fixed order.

0. tensor-parallel sharding (the parallelism's ``shard_tensors``, tp > 1),
1. activation checkpointing of the blocks (``train.activation_checkpointing``),
2. ``torch.compile`` of each block and of the loss (``train.compile``),
3. the parallelism wrapper (ddp, fsdp2...).

Sharding comes last so that FSDP2 sees the checkpointed, compiled blocks as
its units (torchtitan's order). A parallelism whose ``wraps_before_compile``
is true (DDP, as in the seed documents: DDP, then compile) is applied before
step 2 instead.
"""

from __future__ import annotations

from torch import nn

from core.contract.members import member

# Selective checkpointing keeps the outputs of these ops (the expensive ones) and
# recomputes the cheap elementwise work: torchtitan's op-level policy.
SAVE_OPS = {
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
}


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if str(op) in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, spec, mode: str, every: int) -> None:
    """``full``: recompute every ``every``-th block whole; ``selective``: in every block, keep
    matmul and attention outputs and recompute the rest. State-dict names do not change."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = spec.blocks(model)
    for i, block in enumerate(blocks):
        if mode == "full" and i % every == 0:
            _replace(model, block, checkpoint_wrapper(block, preserve_rng_state=False))
        elif mode == "selective":
            _replace(model, block, checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context))


def _await_collectives(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A compiled block's forward pre-hook: an input still awaiting a collective (an
    ``AsyncCollectiveTensor``, e.g. a tensor-parallel embedding's reduce-scatter handed on as a local
    tensor) is waited on here, in eager mode, by a differentiable copy. Passed as it is, AOTAutograd
    (torch 2.13) unwraps it with ``trigger_wait()``, which drops its ``requires_grad``: the compiled
    block's backward then returns no gradient for it and DTensor's ``Redistribute.backward`` before it
    fails on a plain zero tensor ("'Tensor' object has no attribute '_local_tensor'")."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def resolve(a):
        return a.clone() if isinstance(a, AsyncCollectiveTensor) else a

    return tuple(resolve(a) for a in args), {k: resolve(v) for k, v in kwargs.items()}


def apply_compile(model: nn.Module, spec) -> None:
    """``torch.compile`` each block (its inputs' pending collectives waited on first:
    :func:`_await_collectives`), and the loss where the spec offers it (``compile_loss``)."""
    import torch

    from core.contract.protocols import spec_compile_loss

    for block in spec.blocks(model):
        compiled: nn.Module = torch.compile(block)  # type: ignore[assignment]  # a compiled module is a Module
        compiled.register_forward_pre_hook(_await_collectives, with_kwargs=True)
        _replace(model, block, compiled)
    spec_compile_loss(spec, model)


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if child is old:
                module.register_module(child_name, new)
                return
    raise ValueError("block not found in model")


def parallelize(model: nn.Module, spec, parallelism, precision, dist, train) -> nn.Module:
    """Apply tensor-parallel sharding, checkpointing, compile and the parallelism wrapper; return the
    module to call."""
    shard_tensors = member("parallelism", parallelism, "shard_tensors")
    if shard_tensors is not None:
        shard_tensors(model, spec, dist)
    apply_activation_checkpointing(model, spec, train.activation_checkpointing, train.activation_checkpointing_every)
    if member("parallelism", parallelism, "wraps_before_compile"):
        wrapped = parallelism.wrap(model, spec, dist, precision)
        if train.compile:
            apply_compile(model, spec)
        return wrapped
    if train.compile:
        apply_compile(model, spec)
    return parallelism.wrap(model, spec, dist, precision)
