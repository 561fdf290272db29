"""``mixture``: a weighted mixture of data sources.

Global sample ``i`` comes from the source whose weight bin holds
``u_i = frac(offset + i x (golden ratio - 1))``. This additive-recurrence
sequence is equidistributed with very low discrepancy, so the share of each
source over *any* window of consecutive samples is within a few samples of
its weight (not only on average), and the choice depends on the index alone:
the same at every world size and worker count, and exact on resume.

The chosen source serves its own *local* sample ``j``: the number of earlier
global indices that chose it. Indexed sources (``token_bin``, ``synthetic``)
compute ``sample(j)`` from ``(seed, j)``; a finite one (``token_bin`` with
``order = "epochs"``) runs out after one epoch, and then either wraps into
the next epoch (``on_exhausted = "wrap"``: warned, counted in
``data/<label>_epochs``) or ends the run with a checkpoint (``"stop"``). The
check sees each step's whole index range on every rank, so all ranks stop at
the same step.

With ``stages``, each stage's first global sample is fixed from its start fraction and the
run's length in samples (``train.steps`` or ``target_tokens``), and the loader's state saves
these boundaries. A resume with another run length keeps the boundaries already reached
(the samples consumed keep their sources, so no local sample is repeated or skipped) and
moves the ones still ahead to their fractions of the new length, never before the resume
point; one warning names both.

A streaming source (``text_stream``) serves its next window from this rank's
shard instead. Proportions stay exact; the stream's position is saved per
rank, so such a mixture resumes at the same world size only.

```toml
[data]
name = "mixture"
seq_len = 1024
on_exhausted = "wrap"
sources = [
  {name = "token_bin", weight = 0.45, path = "data/fineweb_edu", order = "epochs"},
  {name = "token_bin", weight = 0.25, path = "data/cosmopedia", on_exhausted = "stop"},
  {name = "text_stream", weight = 0.30, files = ["data/qa/*.jsonl"]},
]
```
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from core.api import (
    ConfigError,
    DataError,
    DataExhausted,
    IndexedLoader,
    IndexedSource,
    TokenizerSpec,
    build_component,
    data_end_of_document_id,
    data_has_split,
    log,
    mix_seed,
    option,
)

PHI_FRAC = (math.sqrt(5) - 1) / 2
BLOCK = 1 << 14  # indices per cached block when mapping global -> local sample numbers


@dataclass
class MixtureOptions:
    sources: list[dict[str, Any]] = option([], "tables {name, weight, label?, ...that data plugin's options}")
    stages: list[tuple[float, list[float]]] = option([], "[[start_fraction, [weight per source]], ...]: weights that change during the run")
    on_exhausted: Literal["wrap", "stop"] = option(
        "wrap", "a finite source that runs out: wrap into its next epoch (warned) or stop the run with a checkpoint; a source table may override it"
    )


def normalized(weights: list[float], what: str) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or not np.isfinite(w).all():
        raise ConfigError(f"{what} must be finite numbers >= 0, got {list(weights)}")
    if w.max() > 0:
        w = w / w.max()  # the sum of weights near the largest float would overflow to inf
    if w.sum() <= 0:
        raise ConfigError(f"{what} are all zero")
    return w / w.sum()


def edges(weights: np.ndarray) -> np.ndarray:
    e = np.cumsum(weights)
    e[-1] = 1.0
    return e


# The keys of a sources[i] table that the mixture reads; the rest are the source plugin's options.
SOURCE_KEYS = ("name", "weight", "label", "on_exhausted")


class Mixture(IndexedSource):
    def __init__(self, options: MixtureOptions) -> None:
        if not options.sources:
            raise ConfigError("[data] mixture: sources is empty; give at least one {name, weight, ...} table")
        self.sources: list[Any] = []
        self.labels: list[str] = []
        self.on_exhausted: list[str] = []
        weights = []
        for i, table in enumerate(options.sources):
            where = f"[data] mixture: sources[{i}]"
            name, weight = table.get("name"), table.get("weight")
            label = table.get("label") or f"{i}_{name}"
            if not isinstance(label, str) or not label.strip():
                raise ConfigError(f"{where}.label: expected a non-empty string (it names the source's metrics), got {label!r}")
            if label in self.labels:
                raise ConfigError(
                    f"{where}.label: {label!r} is already the label of another source; labels name the "
                    "data/<label>_tokens and val_loss/<label> metrics and must differ"
                )
            on_exhausted = table.get("on_exhausted", options.on_exhausted)
            if on_exhausted not in ("wrap", "stop"):
                raise ConfigError(f'{where}.on_exhausted: expected "wrap" or "stop", got {on_exhausted!r}')
            if not isinstance(name, str):
                raise ConfigError(f'{where}: needs name = "<data plugin>"')
            if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 <= weight < math.inf:
                raise ConfigError(f"{where}.weight: expected a finite number >= 0, got {weight!r}")
            if name == "mixture":
                raise ConfigError(f"{where}: a mixture cannot contain a mixture")
            source = build_component("data", name, table, where, drop=SOURCE_KEYS)
            if not isinstance(source, IndexedSource) and not hasattr(source, "windows"):
                raise ConfigError(f"{where}: {name!r} is neither addressable by sample index nor a stream of windows")
            self.sources.append(source)
            self.labels.append(label)
            self.on_exhausted.append(on_exhausted)
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
        self.streams = [k for k, src in enumerate(self.sources) if not isinstance(src, IndexedSource)]
        # a stream's rows come from its loader's shard; with stages, which source serves a sample depends on
        # the run's length, which the loader's spec brings (without one every start failed at its first sample)
        self.samples_before_loader = not self.streams and not options.stages
        self.total_samples = 0
        self.stage_bounds: np.ndarray | None = None  # each stage's first global sample (stage_bounds_for())
        self._block_counts = [np.zeros(len(self.sources), dtype=np.int64)]  # counts before each block
        self._block: tuple[int, np.ndarray, np.ndarray] | None = None  # (block, picks, local numbers)
        self._epochs_warned = [0] * len(self.sources)
        self.seq_len = 0

    def validate(self, vocab_size: int, seq_len: int) -> None:
        for source in self.sources:
            source.validate(vocab_size, seq_len)
        self.check_same_tokenizer()

    def check_same_tokenizer(self) -> None:
        """Sources prepared with different tokenizers would mix incompatible ids: refuse them."""
        from plugins.data.token_bin import TokenBin

        seen: dict[str, str] = {}  # fingerprint -> label
        for label, source in zip(self.labels, self.sources):
            if isinstance(source, TokenBin):
                fingerprint = source.meta().get("tokenizer_fingerprint")
                if fingerprint:
                    seen.setdefault(str(fingerprint), label)
        if len(seen) > 1:
            (a, la), (b, lb) = list(seen.items())[:2]
            raise DataError(
                f"[data] mixture: sources {la!r} and {lb!r} were prepared with different tokenizers "
                f"(meta.json tokenizer_fingerprint {a[:12]}... vs {b[:12]}...); prepare them with one tokenizer"
            )

    def tokenizer(self) -> TokenizerSpec | None:
        """The one tokenizer its sources declare (each source's own ``tokenizer()``, the seam any data
        plugin uses); sources that declare none (``synthetic``) are left out. Sources whose tokenizers
        (their files' sha256) or EOS ids differ would mix ids of different texts: one line names two."""
        from core.api import declared_tokenizer

        declared = {}
        for label, source in zip(self.labels, self.sources):
            record = declared_tokenizer(source, f"[data] mixture: source {label!r}")
            if record is not None:
                declared[label] = record
        if not declared:
            return None

        def same(r: dict[str, Any]) -> tuple[str, str | None]:
            return (r["spec"], None) if r["fingerprint"] is None else (r["spec"].partition(":")[0], r["fingerprint"])

        (first, r0), *rest = declared.items()
        for label, r in rest:
            if same(r) != same(r0):
                raise DataError(
                    f"[data] mixture: sources {first!r} ({r0['spec']}) and {label!r} ({r['spec']}) declare different tokenizers "
                    "(other files or sha256): their token ids mean different text; use one tokenizer for every source"
                )
        eos = {label: r["eos_id"] for label, r in declared.items() if r["eos_id"] is not None}
        ids = sorted(set(eos.values()))
        if len(ids) > 1:
            a, b = (next(label for label, e in eos.items() if e == i) for i in ids[:2])
            raise DataError(f"[data] mixture: sources {a!r} and {b!r} declare different EOS ids ({ids[0]} and {ids[1]}) for tokenizer {r0['spec']}")
        return TokenizerSpec(r0["spec"], ids[0] if ids else None)

    def end_of_document_id(self) -> int | None:
        """The one end-of-document id its sources declare (those without one, ``synthetic``, are left
        out: each of their samples is one document); two different ids are refused, naming the sources,
        after two different tokenizers (the cause of two ids, named first)."""
        self.tokenizer()
        ids: dict[int, str] = {}
        for label, source in zip(self.labels, self.sources):
            eod = data_end_of_document_id(source, f"[data] mixture: source {label!r}")
            if eod is not None:
                ids.setdefault(eod, label)
        if len(ids) > 1:
            (a, la), (b, lb) = list(ids.items())[:2]
            raise DataError(f"[data] mixture: sources {la!r} and {lb!r} end documents with different ids ({a} and {b}); expected one end-of-document id")
        return next(iter(ids), None)

    def check_resume(self, saved: dict[str, Any], world_size: int) -> None:
        """Stream sources keep per-rank positions: a resume needs a checkpoint of such a mixture (its
        position beside state.json, not in it), saved at the same world size. The stages of a run stay."""
        position: dict[str, Any] = saved["data"] if isinstance(saved.get("data"), dict) else {}
        starts = position.get("stage_starts")
        if isinstance(starts, list) and len(self.stage_edges) > 1 and len(starts) != len(self.stage_edges):
            raise DataError(
                f"[data] mixture: the checkpoint's data position has {len(starts)} stage(s), this config {len(self.stage_edges)}; "
                "keep the stages of a run (their starts are fixed in samples once reached)"
            )
        if self.streams and position:
            was = saved.get("config", {}).get("data", {}).get("name")
            raise DataError(
                f"[data] mixture: the checkpoint holds a global data position of data source {was!r}, without the positions "
                "of stream sources, which are saved per rank: a mixture with streams cannot continue from it; resume with the "
                "data source as saved, or --checkpoint.exclude_from_loading='[\"data\"]' to restart the data"
            )
        saved_world = saved.get("world_size")
        if self.streams and saved_world != world_size:
            labels = ", ".join(self.labels[k] for k in self.streams)
            raise DataError(
                f"[data] mixture: the stream source(s) {labels} saved their positions on {saved_world} ranks, "
                f"this run has {world_size}; resume with the same world size "
                "(or --checkpoint.exclude_from_loading='[\"data\"]' to restart the data)"
            )

    def has_split(self, split: str) -> bool:
        return all(data_has_split(s, split) for s in self.sources)

    def parts(self) -> dict[str, Any]:
        """The sources by label (the core names those without a validation split)."""
        return dict(zip(self.labels, self.sources))

    def loader(self, spec) -> "MixtureLoader":
        self.seed = spec.seed
        for k, source in enumerate(self.sources):
            source.seed = mix_seed(spec.seed, k + 1)  # two sources over the same files draw different samples
        if spec.split == "train":  # validation loaders must not change the train stream's layout
            if (spec.total_samples, spec.seq_len) != (self.total_samples, self.seq_len):
                self._block_counts, self._block = self._block_counts[:1], None
            self.seq_len, self.total_samples = spec.seq_len, spec.total_samples
            self.stage_bounds = self.stage_bounds_for(spec.total_samples) if spec.total_samples else None
        return MixtureLoader(self, spec)

    def validation_loaders(self, spec) -> dict[str, IndexedLoader]:
        """Each source's own validation batches, by label (``val_loss/<label>``): the source's first
        samples of ``spec.split``, read with the seed the mixture gives it (so the training stream
        it serves is left as it was). Stream sources have no validation split and are left out."""
        self.seed = spec.seed
        loaders = {}
        for k, source in enumerate(self.sources):
            if k in self.streams or not data_has_split(source, spec.split):
                continue
            source.seed = mix_seed(spec.seed, k + 1)  # what loader() gives it; not source.loader(), which reseeds
            loaders[self.labels[k]] = IndexedLoader(source, spec)
        return loaders

    def choose(self, indices: np.ndarray) -> np.ndarray:
        offset = (mix_seed(self.seed, 0x6D6978) % 2**32) / 2**32
        u = np.mod(offset + indices.astype(np.float64) * PHI_FRAC, 1.0)
        if len(self.stage_edges) == 1:
            return np.searchsorted(self.edges, u, side="right").clip(max=len(self.sources) - 1)
        if self.stage_bounds is None:
            raise ConfigError("[data] mixture: stages need the run's length (train.steps or target_tokens)")
        stage = np.searchsorted(self.stage_bounds, indices, side="right") - 1
        out = np.empty(len(indices), dtype=np.int64)
        for k, e in enumerate(self.stage_edges):
            mask = stage == k
            out[mask] = np.searchsorted(e, u[mask], side="right")
        return out.clip(max=len(self.sources) - 1)

    def stage_bounds_for(self, total_samples: int) -> np.ndarray:
        """Each stage's first global sample in a run of ``total_samples``: the first index ``i`` with
        ``i / total_samples >= start`` (in floating point, as the fraction is compared)."""
        bounds = []
        for start in self.stage_starts:
            b = math.ceil(start * total_samples)
            while b > 0 and (b - 1) / total_samples >= start:
                b -= 1
            while b / total_samples < start:
                b += 1
            bounds.append(b)
        return np.asarray(bounds, dtype=np.int64)

    def resume_stages(self, saved: list[int], consumed: int, saved_total: int | None) -> None:
        """The stage boundaries a checkpoint saved (``saved``, at ``consumed`` samples of a run of
        ``saved_total``), fitted to this run's length: those reached stay, those ahead follow this
        run's length, never before ``consumed``; said once when the length changed."""
        fresh = self.stage_bounds_for(self.total_samples) if self.total_samples else np.asarray(saved)
        if len(saved) != len(fresh):
            raise ConfigError(f"[data] mixture: the checkpoint's data position has {len(saved)} stage(s), this config {len(fresh)}; keep the stages of a run")
        bounds = np.asarray([s if s <= consumed else max(int(f), consumed) for s, f in zip(saved, fresh)], dtype=np.int64)
        now, was, alone = bounds.tolist(), list(saved), [int(f) for f in fresh]
        if saved_total is not None and saved_total != self.total_samples:
            log.warn(
                f"[data] mixture: the run's length changed since the checkpoint (train.steps or target_tokens: {saved_total} -> {self.total_samples} samples): "
                f"the stages begun by sample {consumed} keep their starts, those ahead follow the new length: stages start at samples {now} "
                f"(the checkpoint's {was}; a fresh run of this length: {alone})",
                once=f"mixture stages {saved_total} {consumed}",
            )
        if self.stage_bounds is None or not np.array_equal(bounds, self.stage_bounds):
            self.stage_bounds = bounds
            self._block_counts, self._block = self._block_counts[:1], None

    def counts(self, consumed_samples: int) -> np.ndarray:
        """Samples drawn from each source among the first ``consumed_samples`` global indices."""
        block, rest = divmod(consumed_samples, BLOCK)
        while len(self._block_counts) <= block:  # cumulative counts, one bincount per new block
            b = len(self._block_counts) - 1
            picks = self.choose(np.arange(b * BLOCK, (b + 1) * BLOCK))
            self._block_counts.append(self._block_counts[b] + np.bincount(picks, minlength=len(self.sources)))
        tail = self.choose(np.arange(block * BLOCK, block * BLOCK + rest))
        return self._block_counts[block] + np.bincount(tail, minlength=len(self.sources))

    def locate(self, index: int) -> tuple[int, int]:
        """(source, local sample number) of global sample ``index``."""
        block, pos = divmod(index, BLOCK)
        if self._block is None or self._block[0] != block:
            picks = self.choose(np.arange(block * BLOCK, (block + 1) * BLOCK))
            local = np.empty(BLOCK, dtype=np.int64)
            for k in range(len(self.sources)):
                mask = picks == k
                local[mask] = np.arange(int(mask.sum()))
            self._block = (block, picks, local + self.counts(block * BLOCK)[picks])
        return int(self._block[1][pos]), int(self._block[2][pos])

    def pick(self, index: int, split: str) -> tuple[int, int]:
        """(source, the sample number to ask it for). Training counts per source; validation
        passes the global index through (it reads the same first samples each pass)."""
        if split == "train":
            return self.locate(index)
        return int(self.choose(np.asarray([index]))[0]), index

    def sample(self, index: int, seq_len: int, split: str) -> np.ndarray:
        which, local = self.pick(index, split)
        if which in self.streams:
            raise ConfigError(f"[data] mixture: source {self.labels[which]!r} is a stream and has no indexed samples")
        return self.sources[which].sample(local, seq_len, split)

    def check_step(self, first: int, end: int) -> None:
        """Wrap (warned once per epoch) or stop when a finite source runs out inside ``[first, end)``."""
        used = self.counts(end)
        for k, source in enumerate(self.sources):
            if k in self.streams:
                continue
            capacity = source.epoch_samples(self.seq_len, "train")
            if not capacity or used[k] <= capacity * (self._epochs_warned[k] + 1):
                continue
            if self.on_exhausted[k] == "stop":
                raise DataExhausted(f'[data] mixture: source {self.labels[k]!r} ran out after {capacity} samples (one epoch) and on_exhausted = "stop"')
            self._epochs_warned[k] = int((used[k] - 1) // capacity)
            log.warn(f"mixture source {self.labels[k]!r} ran out after {capacity} samples; wrapping into epoch {self._epochs_warned[k] + 1}")

    def check_first_step(self, spec) -> None:
        """A source that stops the run when it runs out (``on_exhausted = "stop"``, a stream's
        ``on_end = "stop"``) must hold its share of the first step, or the run would end at step 0
        with exit code 0, having trained nothing: refused with one line naming it."""
        self.loader(spec)  # the seeds, length and run length the run's loader sets
        share = self.counts(spec.global_batch)
        for k, source in enumerate(self.sources):
            capacity = None if k in self.streams else source.epoch_samples(spec.seq_len, "train")
            if self.on_exhausted[k] == "stop" and capacity is not None and share[k] > capacity:
                self.refuse(k, f"holds {capacity} sample(s) of data.seq_len {spec.seq_len} (one epoch)", f"{share[k]} of them", spec)
        for k in self.streams:
            source = self.sources[k]
            source.check_documents_per_shard(spec.dp_size, spec.dp_size, f"[data] mixture: source {self.labels[k]!r}")
            if source.options.on_end != "stop":
                continue
            rows = [
                [spec.micro_batch * (m * spec.dp_size + r) + j for m in range(spec.grad_accum) for j in range(spec.micro_batch)] for r in range(spec.dp_size)
            ]
            need = [int((self.choose(np.asarray(idx)) == k).sum()) for idx in rows]
            windows = source.shard_windows(spec.seq_len, spec.dp_size, max(need))
            for r, (have, want) in enumerate(zip(windows, need)):
                if have < want:
                    self.refuse(k, f"holds {have} window(s) of data.seq_len + 1 = {spec.seq_len + 1} tokens for rank {r}", f"{want} on that rank", spec)

    def refuse(self, k: int, holds: str, takes: str, spec) -> None:
        source = self.sources[k]
        where = source.file("train") if hasattr(source, "file") else ", ".join(getattr(source, "paths", [])[:2])
        raise DataError(
            f"[data] mixture: source {self.labels[k]!r} ({where}) {holds}; the first step takes {takes} (weight {np.diff(self.stage_edges[0], prepend=0.0)[k]:.3g} of "
            f"{spec.global_batch} samples: train.micro_batch {spec.micro_batch} x {spec.dp_size} rank(s) x accumulation {spec.grad_accum}), and "
            f"it stops the run when it runs out: the run would end at step 0 having trained nothing; add data, lower the batch or let it wrap"
        )

    def fingerprint(self) -> str | None:
        """The sources' fingerprints with their labels and weights; None when any source has none."""
        from core.api import data_fingerprint

        parts = [data_fingerprint(source) for source in self.sources]
        if not parts or any(p is None for p in parts):
            return None
        text = repr(list(zip(self.labels, self.weights, parts)))
        return "mixture " + hashlib.sha256(text.encode()).hexdigest()[:16]

    def tokens_per_epoch(self) -> int | None:
        """The sources' sizes together (each source's own pass is ``data/<label>_epochs``);
        None when any source does not know its size (a stream)."""
        from core.api import data_tokens_per_epoch

        sizes = [data_tokens_per_epoch(source) for source in self.sources]
        known = [n for n in sizes if n]
        return sum(known) if sizes and len(known) == len(sizes) else None

    def metrics(self, consumed_samples: int) -> dict[str, float]:
        used = self.counts(consumed_samples)
        out = {f"data/{label}_tokens": float(n * self.seq_len) for label, n in zip(self.labels, used)}
        for k, source in enumerate(self.sources):
            capacity = None if k in self.streams else source.epoch_samples(self.seq_len, "train")
            if capacity:
                out[f"data/{self.labels[k]}_epochs"] = float(used[k] / capacity)
        return out


class MixtureLoader(IndexedLoader):
    """Indexed rows from the mixture; rows of streaming sources from this rank's shard of each stream."""

    source: Mixture

    def __init__(self, mixture: Mixture, spec) -> None:
        super().__init__(mixture, spec)
        self.per_rank_state = bool(mixture.streams)
        self.may_end = bool(mixture.streams)  # a stream may end, or fail (a bad line), on one rank before the others
        self.shards = {k: mixture.sources[k].windows(spec.seq_len, spec.dp_rank, spec.dp_size, mixture.sources[k].seed, spec.split) for k in mixture.streams}
        self._iters: dict[int, Any] = {}

    def row(self, index: int) -> np.ndarray:
        if not self.shards:
            return super().row(index)
        mix: Mixture = self.source
        which, local = mix.pick(index, self.spec.split)
        if which not in self.shards:
            return mix.sources[which].sample(local, self.spec.seq_len, self.spec.split)
        if which not in self._iters:
            self._iters[which] = iter(self.shards[which])
        try:
            return next(self._iters[which]).numpy()
        except StopIteration:
            raise DataExhausted(f'[data] mixture: stream {mix.labels[which]!r} reached the end of its files (on_end = "stop")') from None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.source.stage_bounds is not None and len(self.source.stage_edges) > 1:  # fixed for the rest of the run
            state["stage_starts"] = [int(b) for b in self.source.stage_bounds]
            state["stage_run_samples"] = int(self.source.total_samples)
        if self.shards:
            state["streams"] = {self.source.labels[k]: shard.state_dict() for k, shard in self.shards.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if isinstance(state.get("stage_starts"), list) and len(self.source.stage_edges) > 1 and self.spec.split == "train":
            total = state.get("stage_run_samples")
            self.source.resume_stages([int(b) for b in state["stage_starts"]], int(state["consumed_samples"]), total if isinstance(total, int) else None)
        for k, shard in self.shards.items():
            shard.load_state_dict(state.get("streams", {}).get(self.source.labels[k], {}))
        self._iters = {}
