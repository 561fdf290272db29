"""``seq_len_stages``: shorter sequences early in the run, longer ones later.

``stages = [[start_fraction, seq_len], ...]``: from step ``start_fraction x
total steps`` on (0-based, rounded up), batches are ``seq_len`` tokens long;
before the first stage, ``data.seq_len``. A stage keeps the tokens per
micro-batch (``train.micro_batch x data.seq_len``) and the data position: at
``seq_len`` half of ``data.seq_len`` a micro-batch holds twice the rows. The
monitor only states the schedule (``plait_seq_len_schedule``); the core checks
it against the batch and the model and switches the loader's shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.api import ConfigError, hookimpl, option


@dataclass
class SeqLenStagesOptions:
    stages: list[tuple[float, int]] = option(
        [], "[[start_fraction, seq_len], ...]: from start_fraction x train steps on, sequences of seq_len tokens (tokens per step kept)"
    )


class SeqLenStages:
    def __init__(self, options: SeqLenStagesOptions) -> None:
        starts = [float(start) for start, _ in options.stages]
        if any(not 0.0 <= s < 1.0 for s in starts) or starts != sorted(set(starts)):
            raise ConfigError(f"[monitors.seq_len_stages] stages: start fractions must rise from >= 0.0 and stay below 1; got {starts}")
        for _, seq in options.stages:
            if int(seq) != seq or seq <= 0:
                raise ConfigError(f"[monitors.seq_len_stages] stages: a stage's seq_len must be a positive integer; got {seq}")
        self.stages = [(float(start), int(seq)) for start, seq in options.stages]

    @hookimpl
    def plait_seq_len_schedule(self, seq_len: int, total_steps: int) -> list[tuple[int, int]] | None:
        if not self.stages:
            return None
        return [(min(total_steps, math.ceil(start * total_steps)), seq) for start, seq in self.stages]
