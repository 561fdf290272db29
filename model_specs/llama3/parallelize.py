"""Tensor + sequence parallelism of the llama3 Transformer (torchtitan's plan, torch's own pieces).

Over a 1-D tensor-parallel mesh of ``tp`` ranks:

* the token embedding is row-wise (vocabulary-sharded) and hands the residual stream on sharded
  along the sequence (``Shard(1)``);
* every RMSNorm runs sequence-parallel (``SequenceParallel``) on its share of the sequence;
* attention and SwiGLU inputs are gathered to the whole sequence, ``wq``/``wk``/``wv`` and
  ``w1``/``w3`` are column-wise (each rank holds n_heads / tp query heads, n_kv_heads / tp key/value
  heads, ffn_dim / tp hidden units), ``wo`` and ``w2`` row-wise with a reduce-scatter back to
  the sequence shards;
* the output head is column-wise and its logits stay vocabulary-sharded: the loss is computed on
  them under ``loss_parallel`` (the parallelism's ``sync_context``), never gathering full logits.

RoPE and the document mask are made from the whole sequence's ids before the blocks, and
attention sees the whole sequence, so both are as without TP.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from core.api import ConfigError
from model_specs.llama3.model import Llama3Options, Transformer


def check_tensor_parallel(args: Llama3Options, tp: int) -> None:
    """Refuse a degree the resolved shapes or options cannot split into (ConfigError, one line)."""
    if tp == 1:
        return
    where = f"[parallelism] tp = {tp} with [model] llama3"
    for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        if getattr(args, name) % tp:
            raise ConfigError(f"{where}: {name} = {getattr(args, name)} is not divisible by tp; expected a multiple of {tp}")
    if args.loss_chunk_tokens:
        raise ConfigError(f"{where}: loss_chunk_tokens (chunked loss) is not supported under tensor parallelism; expected 0 (the loss is vocabulary-parallel)")


def inner_block(module: nn.Module) -> nn.Module:
    """The block inside an activation-checkpoint or torch.compile wrapper."""
    for attr in ("_checkpoint_wrapped_module", "_orig_mod"):
        while hasattr(module, attr):
            module = getattr(module, attr)
    return module


def root_plan() -> dict[str, Any]:
    """The embedding row-wise (vocabulary-sharded, handing on sequence shards), the final norm
    sequence-parallel and the head column-wise with vocabulary-sharded logits (a DTensor)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def attention_plan(qk_norm: bool) -> dict[str, Any]:
    """A block's attention half: its norm sequence-parallel, the whole sequence gathered into the
    attention, ``wq``/``wk``/``wv`` column-wise and ``wo`` row-wise back to sequence shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan = {
        "attention_norm": SequenceParallel(),
        # (x, cos, sin, mask): x gathered to the whole sequence, the rest as given
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if qk_norm:
        # each rank's own heads [B, T, H / tp, head_dim], sharded along the heads: the norm weights replicated,
        # their gradients summed over the ranks
        heads = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan |= {"attention.q_norm": heads, "attention.k_norm": heads}
    return plan


def parallelize_tensor(model: Transformer, tp_mesh: Any) -> None:
    """Shard ``model``'s modules over ``tp_mesh`` in place (see the module's docstring). DTensor is
    imported here, by a run that uses it: loading the plugins leaves it out (seconds of imports)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module

    parallelize_module(model, tp_mesh, root_plan())
    block_plan = attention_plan(model.args.qk_norm) | {
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(inner_block(block), tp_mesh, block_plan)
    # Both are sharded over the vocabulary (row-wise embedding, column-wise head: Shard(0) of the same
    # [vocab, dim] matrix), each distributed as a parameter of its own: tied again, one parameter.
    model.tie_weights()
    model.vocab_parallel = True
