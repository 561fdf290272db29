"""Tensor + sequence parallelism of the looped MoE transformer, over a 1-D tensor-parallel mesh.

Attention, the norms, the residual stream, the embedding and the head are split as llama3's
(:mod:`model_specs.llama3.parallelize`): ``wq``/``wk``/``wv`` column-wise, ``wo`` row-wise, every
RMSNorm and the residual stream sharded along the sequence, the embedding and the head over the
vocabulary, the training loss computed on the vocabulary-sharded logits under ``loss_parallel``.

The MoE layer (router and experts) is kept whole on every tensor-parallel rank: its input is
gathered to the whole sequence, every rank routes and runs the experts on all of the micro-batch's
tokens, and each keeps its own sequence shard of the output (whose gradient is gathered back, so
every rank computes the same full gradients of the router and the experts). Chosen over sharding
each expert's FFN on its hidden dimension because:

* the router, the capacity factor's drops (first come, in token order) and the balance loss
  (fraction routed x mean probability, a product of two means) see the whole sequence, as on one
  process, with no partial sums to reconcile between the router's and the experts' gradients;
* experts are split by expert parallelism (whole experts per rank, tokens exchanged all-to-all,
  over the data-parallel ranks of each tp index: ``ep`` with ``tp``), the axis that divides their
  memory and FLOPs without an all-reduce per expert; TP of one
  expert splits an already narrow FFN (``ffn_dim / tp``) into skinnier matmuls;
* the sparse dispatch (:mod:`model_specs.recurrent_moe.experts`) runs unchanged.

The cost: the MoE FFN's FLOPs and the experts' weights, gradients and optimizer state are not
divided by ``tp`` (``core.plan`` counts them so); its communication is the all-gather of the
layer's input and of its output gradient, as for llama3's SwiGLU.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from core.api import ConfigError
from model_specs.llama3.parallelize import attention_plan, inner_block, root_plan
from model_specs.recurrent_moe.model import MoEArgs, RecurrentMoE


def check_tensor_parallel(args: MoEArgs, tp: int) -> None:
    """Refuse a degree the heads or the vocabulary cannot split into (ConfigError, one line)."""
    if tp == 1:
        return
    for name in ("n_heads", "n_kv_heads", "vocab_size"):
        value = getattr(args.base, name)
        if value % tp:
            raise ConfigError(f"[parallelism] tp = {tp} with [model] recurrent_moe: {name} = {value} is not divisible by tp; expected a multiple of {tp}")


class WholeOnEveryRank:
    """A ``ParallelStyle`` for an MoE layer kept whole on every tensor-parallel rank: its parameters
    replicated DTensors (one mesh with the rest of the model, for FSDP, the optimizer and the gradient
    norm), its input gathered to the whole sequence, its output ``(y, aux, z)`` with ``y`` cut to this
    rank's sequence shard (the backward gathers ``y``'s gradient whole, so every rank computes the same
    full gradients, which the replicated placement declares). Inside, the layer computes on the local
    tensors of its parameters on the tp mesh, swapped in for its forward (and back, also when activation
    checkpointing's recomputation stops early): the sparse dispatch runs as without TP. Expert-parallel
    experts (on their own mesh, an FSDP unit of their own) are left to their own forward."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

        def gather(_module, inputs, mesh):
            (x,) = inputs
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (Shard(1),), run_check=False)
            return (x.redistribute(placements=(Replicate(),)).to_local(),)

        def cut(_module, outputs, mesh):
            y, aux, z = outputs
            y = DTensor.from_local(y, mesh, (Replicate(),), run_check=False).redistribute(placements=(Shard(1),)).to_local()
            return y, aux, z

        forward = module.forward

        def on_local_parameters(*args: Any, **kwargs: Any) -> Any:
            swapped: list[tuple[nn.Module, str, Any]] = []
            for sub in module.modules():
                for name, p in list(sub._parameters.items()):
                    if isinstance(p, DTensor) and p.device_mesh == device_mesh:  # not expert-parallel experts (their own FSDP unit)
                        swapped.append((sub, name, p))
                        sub._parameters[name] = p.to_local()  # type: ignore[assignment]  # a view whose gradient reaches p
            try:
                return forward(*args, **kwargs)
            finally:  # also when activation checkpointing's recomputation stops early (it raises)
                for sub, name, p in swapped:
                    sub._parameters[name] = p

        distribute_module(module, device_mesh, input_fn=gather, output_fn=cut)  # no partition_fn: parameters replicated
        module.forward = on_local_parameters  # type: ignore[method-assign]
        return module


def parallelize_tensor(model: RecurrentMoE, tp_mesh: Any) -> None:
    """Shard ``model``'s modules over ``tp_mesh`` in place (see the module's docstring)."""
    from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel, parallelize_module

    # a ParallelStyle made here: torch.distributed.tensor is imported by a run that uses it, not by loading the plugins
    moe_style = type("WholeOnEveryRank", (WholeOnEveryRank, ParallelStyle), {})()
    parallelize_module(model, tp_mesh, root_plan())
    block_plan = attention_plan(qk_norm=False) | {"ffn_norm": SequenceParallel(), "moe": moe_style}
    for block in model.blocks():
        parallelize_module(inner_block(block), tp_mesh, block_plan)
    model.vocab_parallel = True
    model.tensor_parallel, model.tensor_parallel_group = tp_mesh.size(), tp_mesh.get_group()
