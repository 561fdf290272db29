"""``synthetic``: generated sequences, a pure function of (seed, global sample index).

``kind = "copy"`` sequences repeat their first half, so a model can learn them
and the loss falls; ``kind = "random"`` is uniform noise (for speed tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from core.api import DataError, IndexedSource, mix_seed, option


@dataclass
class SyntheticOptions:
    vocab_size: int = option(0, "token ids are drawn below this; 0 uses the model's vocabulary", ge=0)
    kind: Literal["copy", "random"] = option("copy", "copy: second half repeats the first (learnable); random: noise")


class Synthetic(IndexedSource):
    def __init__(self, options: SyntheticOptions) -> None:
        self.options = options
        self.vocab = options.vocab_size

    def validate(self, vocab_size: int, seq_len: int) -> None:
        if self.options.vocab_size > vocab_size:
            raise DataError(f"[data] synthetic: vocab_size {self.options.vocab_size} exceeds the model's vocabulary {vocab_size}")
        self.vocab = self.options.vocab_size or vocab_size

    def has_split(self, split: str) -> bool:
        return split in ("train", "val")

    def loader(self, spec):
        if not self.vocab:
            raise DataError("[data] synthetic: validate() must run before loader()")
        return super().loader(spec)

    def sample(self, index: int, seq_len: int, split: str) -> np.ndarray:
        seed = mix_seed(self.seed, 1 if split == "val" else 0, index)
        rng = np.random.Generator(np.random.PCG64(seed))
        n = seq_len + 1
        if self.options.kind == "random":
            return rng.integers(0, self.vocab, n, dtype=np.int64)
        half = rng.integers(0, self.vocab, (n + 1) // 2, dtype=np.int64)
        return np.concatenate([half, half])[:n]
