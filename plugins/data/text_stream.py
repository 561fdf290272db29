"""``text_stream``: jsonl or parquet text read lazily, tokenized on the fly, packed, resumable.

Documents are numbered in file order. Shard ``k`` of ``K = world_size x
workers`` (rank-major) takes documents ``k, k + K, k + 2K, ...``, tokenizes
them, appends EOS, and packs the tokens into windows of ``seq_len + 1``. An
optional shuffle buffer holds ``shuffle_buffer`` windows per shard; which one
leaves next is drawn from ``(seed, shard, position)`` alone, never from a
worker's RNG, so a resume continues the very same stream. torchdata's
``StatefulDataLoader`` saves each worker's cursor, packing carry-over and
buffer mid-epoch. At the end of the files a shard either starts over
(``on_end = "wrap"``, with a warning; the epoch is part of the saved state) or
ends (``on_end = "stop"``) after serving the windows still in its shuffle buffer. Shards end at different moments, and a
bad line is met by each rank when its own reading reaches it (shards of short documents read further
per window), so a stream's loader sets ``may_end``, whether it stops or wraps: the trainer gathers each
step's micro-batches first and all ranks agree (one all-reduce of a flag) before any compute, ending the
run together with a checkpoint instead of one rank hanging in a collective.

A ``mixture`` can hold text streams next to indexed sources: it pulls the
windows of this rank's shard in order (no worker processes there).

Before training, the first documents of every file are read (valid JSON
objects with a string ``text_field``, or a parquet string column; an empty file
is refused), so a wrong format fails with one line instead of in a worker.

The state belongs to the layout of shards, so a streaming run resumes at the
same world size and worker count (checked before training); use ``token_bin`` (or a ``mixture`` of
them) for runs that change size.
"""

from __future__ import annotations

import copy
import glob
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch

from core.api import DataError, TokenizerSpec, ignore_stop_signals, log, mix_seed, option, shut_down_at_exit, worker_context

PEEK_DOCUMENTS = 8  # documents of each file read before training: a bad format fails at once


@dataclass
class TextStreamOptions:
    files: list[str] = option([], "jsonl or parquet files (globs allowed), read in this order", path=True)
    tokenizer: str = option("bytes", "bytes | hf:PATH/tokenizer.json | tiktoken:PATH (a relative PATH: from the working directory, not the config file)")
    text_field: str = option("text", "jsonl key / parquet column with the text")
    shuffle_buffer: int = option(0, "windows held per shard for shuffling (0: in order)", ge=0)
    workers: int = option(0, "loader worker processes per rank (StatefulDataLoader); a resume needs the same number", ge=0)
    on_end: Literal["wrap", "stop"] = option("wrap", "at the end of the files: wrap (start a new epoch, warned) or stop the run with a checkpoint")


class _Shard(torch.utils.data.IterableDataset):
    def __init__(self, opts: TextStreamOptions, files: list[str], seq_len: int, rank: int, world: int, seed: int, split: str):
        self.opts, self.files, self.seq_len = opts, files, seq_len
        self.rank, self.world, self.seed, self.split = rank, world, seed, split
        self.state: dict[str, Any] | None = None  # per worker, set in __iter__ or by load_state_dict

    def _tokenizer(self):
        from plugins.data.prepare import Tokenizer

        return Tokenizer(self.opts.tokenizer, None)

    def _documents(self, start: int) -> Iterator[tuple[int, str]]:
        from pathlib import Path

        from plugins.data.prepare import documents

        index = 0
        for f in self.files:
            for text in documents(Path(f), self.opts.text_field):
                if index >= start:
                    yield index, text
                index += 1

    def state_dict(self) -> dict[str, Any]:
        # a copy: the worker pickles it later, and the trainer keeps the one from before each step
        # (core.data.step_batches), while iteration goes on extending the carry-over and moving
        # windows in and out of the buffer. A window is never changed once cut, so the two lists
        # are copied and the windows shared (a deep copy took ~8 ms a step with a 64-window buffer).
        if not self.state:
            return {}
        return {**self.state, "carry": list(self.state["carry"]), "buffer": list(self.state["buffer"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = copy.deepcopy(state) if state else None

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, wid = (info.num_workers, info.id) if info else (1, 0)
        shards, shard = self.world * workers, self.rank * workers + wid
        if self.state and (self.state.get("shards") != shards or self.state.get("shard") != shard):
            raise DataError(
                f"[data] text_stream: saved position is for shard {self.state.get('shard')} of "
                f"{self.state.get('shards')}, this loader is shard {shard} of {shards}: streaming sources "
                "resume at the same world size and worker count"
            )
        st = self.state or {"shard": shard, "shards": shards, "next_doc": shard, "carry": [], "buffer": [], "position": 0, "epoch": 0}
        self.state = st
        tok = self._tokenizer()
        n = self.seq_len + 1
        for window in self._refit(st, n):  # a position saved at another seq_len or shuffle_buffer
            yield torch.tensor(window, dtype=torch.int64)
        while True:
            produced = False
            for index, text in self._documents(st["next_doc"]):
                if (index - shard) % shards:
                    continue
                st["next_doc"] = index + shards
                produced = True
                st["carry"] += tok.encode(text) + [tok.eos_id]
                while len(st["carry"]) >= n:
                    window, st["carry"] = st["carry"][:n], st["carry"][n:]
                    out = self._through_buffer(st, window)
                    if out is not None:
                        yield torch.tensor(out, dtype=torch.int64)
            if not produced and st["epoch"] == 0 and st["next_doc"] == shard:
                raise DataError(f"[data] text_stream: shard {shard} of {shards} received no document; fewer documents than shards")
            if self.opts.on_end == "stop":
                if st["position"] == 0:  # the run would end at step 0 with exit code 0, having trained nothing
                    raise DataError(
                        f"[data] text_stream: shard {shard} of {shards} holds {len(st['carry'])} tokens in all, fewer than one "
                        f"window of data.seq_len + 1 = {n}; lower data.seq_len, add documents or use fewer ranks/workers"
                    )
                while st["buffer"]:  # the windows still held for shuffling are data too: drain them
                    yield torch.tensor(self._draw(st), dtype=torch.int64)
                log.note(f'text_stream shard {shard}: end of the files (on_end = "stop")', all_ranks=True)
                return
            st["epoch"] += 1
            st["next_doc"] = shard
            log.warn(f"text_stream shard {shard}: end of the files, starting epoch {st['epoch']}", all_ranks=True)

    def _refit(self, st, n: int) -> Iterator[list[int]]:
        """Fit a restored position to this loader's window length ``n`` and buffer size: windows
        buffered at another ``seq_len`` (a sequence-length stage, a resume with another length) are
        cut again, their tokens ahead of the carry-over, and a buffer fuller than this
        ``shuffle_buffer`` holds serves its surplus first. Nothing is dropped; all from the state."""
        if any(len(w) != n for w in st["buffer"]):
            tokens = [t for w in st["buffer"] for t in w] + st["carry"]
            whole = len(tokens) // n * n
            st["buffer"] = [tokens[i : i + n] for i in range(0, whole, n)]
            st["carry"] = tokens[whole:]
        while st["buffer"] and len(st["buffer"]) >= max(self.opts.shuffle_buffer, 1):
            yield self._draw(st)

    def _through_buffer(self, st, window):
        size = self.opts.shuffle_buffer
        st["position"] += 1
        if size <= 1:
            return window
        st["buffer"].append(window)
        if len(st["buffer"]) < size:
            return None
        return self._draw(st, counted=True)

    def _draw(self, st, counted: bool = False):
        """Take the buffer's next window, picked by ``(seed, shard, position)``."""
        if not counted:
            st["position"] += 1
        pick = mix_seed(self.seed, st["shard"], st["position"]) % len(st["buffer"])
        st["buffer"][pick], st["buffer"][-1] = st["buffer"][-1], st["buffer"][pick]
        return st["buffer"].pop()


def worker_message(text: str) -> str:
    """The one line a worker's DataError said, out of the "Caught DataError in DataLoader worker
    process N. Original Traceback ..." text torch re-raises it with; ``text`` itself otherwise."""
    if not text.startswith("Caught DataError in DataLoader worker"):
        return text
    last = text.rstrip().splitlines()[-1]  # "core.contract.errors.DataError: <the message>"
    return last.split(": ", 1)[1] if last.split(": ", 1)[0].endswith("DataError") else last


class StreamLoader:
    """The DataLoaderLike the trainer iterates: (inputs, labels) micro-batches; state per rank."""

    per_rank_state = True

    def __init__(self, source: "TextStream", spec) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        # it may end on one rank before the others, or fail there (a bad line reached first, a shard without documents)
        self.may_end = True
        self.dataset = source.windows(spec.seq_len, spec.dp_rank, spec.dp_size, spec.seed, spec.split)
        workers = source.options.workers
        self.loader = StatefulDataLoader(
            self.dataset,
            batch_size=spec.micro_batch,
            num_workers=workers,
            drop_last=source.options.on_end == "stop",
            worker_init_fn=ignore_stop_signals if workers else None,
            multiprocessing_context=worker_context(__name__) if workers else None,  # never forked from the rank (core.data.worker_start)
        )
        self._it = None

    def __iter__(self):
        self._it = shut_down_at_exit(iter(self.loader))
        try:
            for batch in self._it:
                yield batch[:, :-1], batch[:, 1:]
        except DataError as e:  # from a worker, torch wraps the one-line message in its traceback
            raise DataError(worker_message(str(e))) from None

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()  # the workers at the old position: they would live on beside the new ones until the next batch
        self.loader.load_state_dict(state["stream"])

    def close(self) -> None:
        """End the worker processes of the current iteration, if any."""
        it, self._it = self._it, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


class TextStream:
    def __init__(self, options: TextStreamOptions) -> None:
        self.options = options
        self.paths: list[str] = []

    def validate(self, vocab_size: int, seq_len: int) -> None:
        from plugins.data.prepare import Tokenizer

        if not self.options.files:
            raise DataError("[data] text_stream: files is empty")
        paths = []
        for pattern in self.options.files:
            found = sorted(glob.glob(pattern)) or []
            if not found:
                raise DataError(f"[data] text_stream: {pattern} matches no file")
            paths += found
        bad = [p for p in paths if not p.endswith((".jsonl", ".parquet"))]
        if bad:
            raise DataError(f"[data] text_stream: {bad[0]} is not .jsonl or .parquet")
        self.paths = paths
        for p in paths:
            self.peek(p)
        tok = Tokenizer(self.options.tokenizer, None)
        if tok.vocab_size > vocab_size:
            raise DataError(f"[data] text_stream: tokenizer {self.options.tokenizer} has {tok.vocab_size} ids, more than the model's vocabulary {vocab_size}")

    def tokenizer(self) -> TokenizerSpec:
        """The tokenizer it encodes with (``[data] tokenizer``, from the working directory), its own EOS."""
        return TokenizerSpec(self.options.tokenizer)

    def end_of_document_id(self) -> int:
        """The tokenizer's EOS, which ends every document in the packed windows."""
        from plugins.data.prepare import Tokenizer

        return Tokenizer(self.options.tokenizer, None).eos_id

    def peek(self, path: str) -> None:
        """Read the first documents of ``path``: a malformed line or an empty file is a DataError now."""
        from itertools import islice
        from pathlib import Path

        from plugins.data.prepare import documents

        if not list(islice(documents(Path(path), self.options.text_field), PEEK_DOCUMENTS)):
            raise DataError(f"[data] text_stream: {path} holds no document (empty file)")

    def fingerprint(self) -> str | None:
        """The files' names and sizes in reading order, and the tokenizer (after ``validate``)."""
        import hashlib
        import os

        if not self.paths:
            return None
        sizes = [os.path.getsize(p) for p in self.paths]
        listing = "\n".join(f"{os.path.basename(p)} {n}" for p, n in zip(self.paths, sizes)) + f"\n{self.options.tokenizer}"
        return f"{len(self.paths)} file(s), {sum(sizes)} bytes, sha256 {hashlib.sha256(listing.encode()).hexdigest()[:16]}"

    def check_resume(self, saved: dict[str, Any], world_size: int) -> None:
        """Before resuming from a checkpoint whose state.json is ``saved``: a stream position (not the
        global sample index of an indexed source), saved at the same world size and workers."""
        if saved.get("data"):  # a stream's position is saved per rank, beside state.json, never in it
            was = saved.get("config", {}).get("data", {}).get("name")
            raise DataError(
                f"[data] text_stream: the checkpoint holds the global data position of data source {was!r} "
                f"(sample {saved['data'].get('consumed_samples', '?')}), not a stream's position; a stream cannot continue from it: "
                f"resume with [data] name = {was!r} as saved, or --checkpoint.exclude_from_loading='[\"data\"]' to start the stream from its beginning"
            )
        saved_workers = saved.get("config", {}).get("data", {}).get("workers", 0)
        saved_world = saved.get("world_size")
        if saved_world != world_size or saved_workers != self.options.workers:
            raise DataError(
                f"[data] text_stream: the checkpoint's stream position was saved with {saved_world} ranks x "
                f"workers = {saved_workers}, this run has {world_size} x workers = {self.options.workers}; "
                "resume with the same world size and [data].workers (or --checkpoint.exclude_from_loading='[\"data\"]')"
            )

    def has_split(self, split: str) -> bool:
        return split == "train"

    def shard_windows(self, seq_len: int, shards: int, enough: int) -> list[int]:
        """The windows of ``seq_len + 1`` tokens each of ``shards`` shards holds in one pass over
        the files, each counted up to ``enough``: the files are read only as far as that takes."""
        from pathlib import Path

        from plugins.data.prepare import Tokenizer, documents

        tok, n = Tokenizer(self.options.tokenizer, None), seq_len + 1
        tokens = [0] * shards
        index = 0
        for f in self.paths:
            for text in documents(Path(f), self.options.text_field):
                k, index = index % shards, index + 1
                if tokens[k] < enough * n:
                    tokens[k] += len(tok.encode(text)) + 1  # + EOS
                elif min(tokens) >= enough * n:
                    return [enough] * shards
        return [min(t // n, enough) for t in tokens]

    def check_documents_per_shard(self, shards: int, ranks: int, where: str) -> None:
        """Every one of ``shards`` shards (``ranks`` ranks' worth) takes at least one document, or the ones
        without any fail at their first read, after the model was built. Reads at most ``shards`` documents."""
        from itertools import islice
        from pathlib import Path

        from plugins.data.prepare import documents

        found = sum(1 for _ in islice((d for f in self.paths for d in documents(Path(f), self.options.text_field)), shards))
        if found < shards:
            per_rank = shards // ranks
            files = self.paths[0] + (f" and {len(self.paths) - 1} more file(s)" if len(self.paths) > 1 else "")
            raise DataError(
                f"{where}: {files} hold{'s' * (len(self.paths) == 1)} {found} document(s), fewer than its {shards} shards ({ranks} rank(s)"
                f"{f' x workers = {per_rank}' if per_rank > 1 else ''}), which take one document in turn each: shard {found} (rank {found // per_rank}) "
                "would have no data; add documents, or use fewer ranks or workers"
            )

    def check_first_step(self, spec) -> None:
        """Every shard takes a document; and with ``on_end = "stop"`` every rank's shards must hold the
        first step's windows (its ``micro_batch x grad_accum``), or the run would end at step 0 with exit
        code 0, having trained nothing. The files are read (tokenized) only as far as that takes."""
        if not self.paths:
            return
        self.check_documents_per_shard(spec.dp_size * max(1, self.options.workers), spec.dp_size, "[data] text_stream")
        if self.options.on_end != "stop":
            return
        workers, need = max(1, self.options.workers), spec.micro_batch * spec.grad_accum
        windows = self.shard_windows(spec.seq_len, spec.dp_size * workers, need)
        for rank in range(spec.dp_size):
            mine = windows[rank * workers : (rank + 1) * workers]
            if sum(w // spec.micro_batch for w in mine) < spec.grad_accum:  # a worker serves whole micro-batches
                files = self.paths[0] + (f" and {len(self.paths) - 1} more file(s)" if len(self.paths) > 1 else "")
                raise DataError(
                    f"[data] text_stream: {files} hold{'s' * (len(self.paths) == 1)} {sum(mine)} window(s) of data.seq_len + 1 = "
                    f"{spec.seq_len + 1} tokens for rank {rank} of {spec.dp_size} (workers = {self.options.workers}); its first step needs "
                    f'train.micro_batch {spec.micro_batch} x accumulation {spec.grad_accum} = {need}, and on_end = "stop" would end the run '
                    "at step 0 having trained nothing; add documents, or lower data.seq_len, the batch or the ranks"
                )

    def windows(self, seq_len: int, rank: int, world: int, seed: int, split: str = "train") -> _Shard:
        """This rank's stream of ``seq_len + 1``-token windows; ``state_dict``/``load_state_dict``
        save and restore its position (used directly by ``mixture``)."""
        return _Shard(self.options, self.paths, seq_len, rank, world, seed, split)

    def loader(self, spec) -> StreamLoader:
        return StreamLoader(self, spec)
