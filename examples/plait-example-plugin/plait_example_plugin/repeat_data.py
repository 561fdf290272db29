"""``repeat``: a synthetic map-style data source whose next token is always predictable.

Each sample is a run of consecutive ids modulo ``period``, starting at a
point drawn from ``(seed, index)`` alone, so the loss can fall towards zero
and a resumed run sees exactly the samples it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.api import DataError, IndexedSource, option


@dataclass
class RepeatOptions:
    period: int = option(64, "ids cycle through 0 .. period - 1", gt=1)


class Repeat(IndexedSource):
    def __init__(self, options: RepeatOptions) -> None:
        self.options = options

    def validate(self, vocab_size: int, seq_len: int) -> None:
        if self.options.period > vocab_size:
            raise DataError(f"[data] repeat: period {self.options.period} exceeds the model's vocabulary {vocab_size}")

    def has_split(self, split: str) -> bool:
        return split in ("train", "val")

    def sample(self, index: int, seq_len: int, split: str) -> np.ndarray:
        rng = np.random.default_rng((self.seed, index, split == "val"))
        start = int(rng.integers(self.options.period))
        return (start + np.arange(seq_len + 1, dtype=np.int64)) % self.options.period
