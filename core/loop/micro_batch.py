"""``train.micro_batch = "auto"``: the largest micro-batch that fits, with the global batch unchanged.

Candidates are the micro-batches ``m <= train.micro_batch_max`` for which
``global_batch_tokens`` divides by ``m x seq_len x world_size``, largest
first. On CPU the largest candidate is used (the ceiling is the budget). On
CUDA each candidate is tried with a real forward and backward pass, with the
optimizer's future state allocated beside it, until one fits; every rank
then takes the smallest rank's answer.
"""

from __future__ import annotations

import torch

from core.contract.errors import ConfigError


def fits(model: torch.nn.Module, precision, device: torch.device, micro: int, seq_len: int, vocab: int, extra_bytes: int) -> bool:
    reserve = None
    try:
        reserve = torch.empty(extra_bytes, dtype=torch.uint8, device=device) if extra_bytes else None
        ids = torch.randint(0, vocab, (micro, seq_len), device=device)
        with precision.autocast(device):
            loss = model(ids, ids)
        loss.backward()
        torch.cuda.synchronize(device)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del reserve
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def probe(model, precision, device: torch.device, cands: list[int], seq_len: int, vocab: int, extra_bytes: int) -> int:
    """The largest candidate that runs a forward and backward pass on ``device``."""
    for micro in cands:
        if fits(model, precision, device, micro, seq_len, vocab, extra_bytes):
            return micro
    raise ConfigError(f'train.micro_batch = "auto": even micro-batch {cands[-1]} x seq {seq_len} does not fit on {device}')
