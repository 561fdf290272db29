"""Losses that model specs can share.

``chunked_cross_entropy`` computes the output projection and the
cross-entropy a slice of tokens at a time, recomputing each slice in the
backward pass, so the full ``[tokens, vocab]`` logits never exist at once. At
vocab 131072 the logits of a [64, 2048] batch alone would be 34 GB in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` (-100 ignored).

    ``hidden`` is [N, d] (or [B, T, d]), ``weight`` [vocab, d], ``labels`` [N]
    (or [B, T]). Peak extra memory is one chunk of logits.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_chunk_loss_sum, hidden[start:end], weight, labels[start:end], use_reentrant=False)
    count = (labels != -100).sum().clamp(min=1)
    return total / count
