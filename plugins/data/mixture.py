"""``mixture``: a weighted mixture of map-style data sources.

Global sample ``i`` comes from the source whose weight bin holds
``u_i = frac(offset + i x (golden ratio - 1))``. This additive-recurrence
sequence is equidistributed with very low discrepancy, so the share of each
source over *any* window of consecutive samples is within a few samples of
its weight (not only on average), and the choice depends on the index alone:
the same at every world size and worker count, and exact on resume. The
chosen source then serves its own ``sample(i)``, which is itself a function of
``(seed, i)``.

```toml
[data]
name = "mixture"
seq_len = 1024
sources = [
  {name = "token_bin", weight = 0.45, path = "data/fineweb_edu"},
  {name = "token_bin", weight = 0.25, path = "data/cosmopedia"},
]
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.data import IndexedSource, mix_seed
from core.errors import ConfigError
from core.options import option

PHI_FRAC = (math.sqrt(5) - 1) / 2


@dataclass
class MixtureOptions:
    sources: list[dict[str, Any]] = option([], "tables {name, weight, label?, ...that data plugin's options}")
    stages: list[tuple[float, list[float]]] = option([], "[[start_fraction, [weight per source]], ...]: weights that change during the run")


def normalized(weights: list[float], what: str) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any():
        raise ConfigError(f"{what} must be >= 0, got {list(weights)}")
    if w.sum() <= 0:
        raise ConfigError(f"{what} are all zero")
    return w / w.sum()


def edges(weights: np.ndarray) -> np.ndarray:
    e = np.cumsum(weights)
    e[-1] = 1.0
    return e


class Mixture(IndexedSource):
    def __init__(self, options: MixtureOptions) -> None:
        from core import registry as registry_mod
        from core.options import build_options

        if not options.sources:
            raise ConfigError("[data] mixture: sources is empty; give at least one {name, weight, ...} table")
        registry = registry_mod.load()
        self.sources: list[IndexedSource] = []
        self.labels: list[str] = []
        weights = []
        for i, table in enumerate(options.sources):
            table = dict(table)
            where = f"[data] mixture: sources[{i}]"
            name, weight = table.pop("name", None), table.pop("weight", None)
            label = table.pop("label", None) or f"{i}_{name}"
            if not isinstance(name, str):
                raise ConfigError(f"{where}: needs name = \"<data plugin>\"")
            if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight < 0:
                raise ConfigError(f"{where}.weight: expected a number >= 0, got {weight!r}")
            component = registry.get("data", name, where)
            if component.name == "mixture":
                raise ConfigError(f"{where}: a mixture cannot contain a mixture")
            source = component.factory(build_options(component.options, table, f"{where} ({name})"))
            if not isinstance(source, IndexedSource):
                raise ConfigError(f"{where}: {name!r} is not addressable by sample index (a map-style source is required)")
            self.sources.append(source)
            self.labels.append(label)
            weights.append(float(weight))
        self.weights = normalized(weights, "[data] mixture: the weights")
        self.edges = edges(self.weights)
        self.stage_starts = np.asarray([0.0])
        self.stage_edges = [self.edges]
        if options.stages:
            starts = [float(f) for f, _ in options.stages]
            if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= 1:
                raise ConfigError(f"[data] mixture: stages must start at 0.0 and rise below 1; got {starts}")
            for start, ws in options.stages:
                if len(ws) != len(self.sources):
                    raise ConfigError(f"[data] mixture: stage at {start} gives {len(ws)} weights for {len(self.sources)} sources")
            self.stage_starts = np.asarray(starts)
            self.stage_edges = [edges(normalized(ws, f"[data] mixture: stage {f} weights")) for f, ws in options.stages]
        self.total_samples = 0
        self._counted_upto = 0
        self._counts = np.zeros(len(self.sources), dtype=np.int64)

    def validate(self, vocab_size: int, seq_len: int) -> None:
        for source in self.sources:
            source.validate(vocab_size, seq_len)

    def has_split(self, split: str) -> bool:
        return all(getattr(s, "has_split", lambda _: True)(split) for s in self.sources)

    def loader(self, spec):
        for source in self.sources:
            source.seed = spec.seed
        self.seq_len = spec.seq_len
        self.total_samples = spec.total_samples
        return super().loader(spec)

    def choose(self, indices: np.ndarray) -> np.ndarray:
        offset = (mix_seed(self.seed, 0x6D6978) % 2**32) / 2**32
        u = np.mod(offset + indices.astype(np.float64) * PHI_FRAC, 1.0)
        if len(self.stage_edges) == 1:
            return np.searchsorted(self.edges, u, side="right").clip(max=len(self.sources) - 1)
        if not self.total_samples:
            raise ConfigError("[data] mixture: stages need the run's length (train.steps or target_tokens)")
        stage = np.searchsorted(self.stage_starts, indices / self.total_samples, side="right") - 1
        out = np.empty(len(indices), dtype=np.int64)
        for k, e in enumerate(self.stage_edges):
            mask = stage == k
            out[mask] = np.searchsorted(e, u[mask], side="right")
        return out.clip(max=len(self.sources) - 1)

    def sample(self, index: int, seq_len: int, split: str) -> np.ndarray:
        which = int(self.choose(np.asarray([index]))[0])
        return self.sources[which].sample(index, seq_len, split)

    def counts(self, consumed_samples: int) -> np.ndarray:
        """Samples drawn from each source among the first ``consumed_samples`` global indices."""
        if consumed_samples < self._counted_upto:
            self._counted_upto, self._counts[:] = 0, 0
        if consumed_samples > self._counted_upto:
            picks = self.choose(np.arange(self._counted_upto, consumed_samples))
            self._counts += np.bincount(picks, minlength=len(self.sources))
            self._counted_upto = consumed_samples
        return self._counts

    def metrics(self, consumed_samples: int) -> dict[str, float]:
        tokens = self.counts(consumed_samples) * getattr(self, "seq_len", 0)
        return {f"data/{label}_tokens": float(t) for label, t in zip(self.labels, tokens)}
