"""``train.inject_spike_at_step``: a rehearsal of a loss spike, to test spike handling on purpose.

For :data:`SPIKE_BATCHES` steps the real batches are consumed and replaced by
tokens from the top 1% of the id range (the rarest in a BPE vocabulary). The
window is keyed on the data position, not the step number, so a rollback
(which keeps the data position) does not replay it.
"""

from __future__ import annotations

from typing import Any

import torch

SPIKE_BATCHES = 5  # steps of rare-token batches


def due(inject_at_step: int, step: int, position: dict[str, Any], samples_per_step: int) -> bool:
    """Is step ``step + 1`` inside the rehearsal? ``position``: the loader's state before its batches."""
    if inject_at_step <= 0:
        return False
    consumed = position.get("consumed_samples")
    if consumed is None:
        return inject_at_step <= step + 1 < inject_at_step + SPIKE_BATCHES
    return (inject_at_step - 1) * samples_per_step <= consumed < (inject_at_step - 1 + SPIKE_BATCHES) * samples_per_step


def batch(shape: torch.Size, vocab: int, seed: int, step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rare-token (inputs, labels) pair: a pure function of (seed, step, rank, micro-step)."""
    low = max(0, vocab - max(vocab // 100, 2))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank * 31 + micro)
    rows = torch.randint(low, vocab, (shape[0], shape[1] + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]
