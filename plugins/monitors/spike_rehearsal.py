"""``spike_rehearsal``: a loss spike on purpose, to rehearse what spike handling does.

From step ``at_step`` on, the batches of ``steps`` steps are replaced by
tokens from the top 1% of the id range (the rarest tokens of a BPE
vocabulary), through the ``plait_replace_batch`` hook; the real batches are
consumed all the same. Each step number is replaced once per process, so a
rollback (which brings the step count back) does not replay the steps it
already rehearsed, and the rehearsal ends after ``steps`` replaced steps
however many rollbacks come between. A run resumed from a checkpoint inside
the window rehearses its remaining steps. The batches are a pure function of
``(train.seed, step, rank, micro-step)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from core.api import hookimpl, log, option


@dataclass
class SpikeRehearsalOptions:
    at_step: int = option(100, "first step (1-based) whose batches are replaced with rare tokens", gt=0)
    steps: int = option(5, "how many steps get rare-token batches", gt=0)


class SpikeRehearsal:
    def __init__(self, options: SpikeRehearsalOptions) -> None:
        self.options = options
        self.replaced: set[int] = set()  # step numbers rehearsed in this process
        self.now = False  # is the step under way rehearsed?

    @hookimpl
    def plait_replace_batch(self, run: Any, step: int, micro: int, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        o = self.options
        if micro == 0:  # the step's first micro-batch decides for the whole step
            self.now = step >= o.at_step and step not in self.replaced and len(self.replaced) < o.steps
            if self.now:
                self.replaced.add(step)
                log.info(f"step {step}: injected spike batch (spike_rehearsal)")
        if not self.now:
            return None
        return self.batch(inputs.shape, run.spec.vocab_size, int(run.config["train"]["seed"]), step, run.dist.rank, micro)

    @staticmethod
    def batch(shape: torch.Size, vocab: int, seed: int, step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A rare-token (inputs, labels) pair of ``shape``: a pure function of its arguments."""
        low = max(0, vocab - max(vocab // 100, 2))
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank * 31 + micro)
        rows = torch.randint(low, vocab, (shape[0], shape[1] + 1), generator=g)
        return rows[:, :-1], rows[:, 1:]
