"""Losses that model specs can share.

``chunked_cross_entropy`` computes the output projection and the
cross-entropy a slice of tokens at a time, recomputing each slice in the
backward pass, so the full ``[tokens, vocab]`` logits never exist at once. At
vocab 131072 the logits of a [64, 2048] batch alone would be 34 GB in fp32.

With ``compiled=True`` (``train.compile``, through the model spec's
``compile_loss``) each checkpointed chunk runs as one ``torch.compile`` graph:
the output matmul, the fp32 upcast, log-softmax and the gather fuse, and the
recomputation in the backward pass stays (dynamo turns the checkpoint into a
recompute region). The same chunk function serves every chunk, so a run
compiles it at most twice (the full chunks, then dynamic shapes for a shorter
last one). :func:`output_cross_entropy` is the unchunked form, compiled the same way.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def _checkpointed_chunk(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return checkpoint(_chunk_loss_sum, hidden, weight, labels, use_reentrant=False)


def _output_loss_mean(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=-100)


@functools.cache
def compiled(fn):
    """``torch.compile(fn)``, made once per process (one cache of guards and graphs for every model)."""
    return torch.compile(fn)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, compile: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` (-100 ignored).

    ``hidden`` is [N, d] (or [B, T, d]), ``weight`` [vocab, d], ``labels`` [N]
    (or [B, T]). Peak extra memory is one chunk of logits.
    """
    chunk = compiled(_checkpointed_chunk) if compile else _checkpointed_chunk
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    total: torch.Tensor | None = None
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        part = chunk(hidden[start:end], weight, labels[start:end])
        total = part if total is None else total + part
    count = (labels != -100).sum().clamp(min=1)
    assert total is not None, "no tokens to take the loss of"
    return total / count


def output_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, compile: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` (fp32 logits) against ``labels``, all tokens at once."""
    fn = compiled(_output_loss_mean) if compile else _output_loss_mean
    return fn(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1))
