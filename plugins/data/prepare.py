"""``python -m plugins.data.prepare``: tokenize text into nanoGPT's train.bin / val.bin.

    python -m plugins.data.prepare --input corpus/ more.jsonl --out data/mine \\
        --tokenizer hf:tokenizer.json --val-fraction 0.01 --workers 8

Inputs: ``.txt`` (one document per file), ``.jsonl`` (one document per line,
``--text-field``), ``.parquet`` (pyarrow, ``--text-field`` column), or
folders of them. Tokenizers: ``bytes`` (UTF-8 bytes, EOS 256),
``hf:PATH/tokenizer.json`` (the ``tokenizers`` library), or
``tiktoken:PATH.tiktoken`` (a BPE ranks file on disk, with ``--eos-id``).
EOS separates documents. Documents go to the validation split by a hash of
their file's name (from its input folder, not the path as typed) and their
position, so the split is deterministic. Re-running with the same
inputs and settings finds a matching ``meta.json`` and does nothing.

Memory stays bounded whatever the input size: files are streamed into tasks
of about ``--chunk-bytes`` of input, ``--workers`` processes tokenize them
(at most two tasks per worker in flight), and each task's tokens are
appended to the output in the on-disk dtype, in input order, so the bytes
written do not depend on the number of workers. A progress bar on stderr
shows bytes read, documents, tokens, tokens/s and the ETA while a file is
being read (docs/data.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator, cast

import numpy as np

from core.errors import ArgumentParser, DataError, PlaitError, exit_bad_input
from dataloading.tokenizer_spec import read_tokenizer_file


def need(module: str, what: str) -> None:
    """Import ``module`` (an optional dependency, the ``data`` extra) or say in one line that ``what`` needs it."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        raise DataError(f"{what} needs the {module.split('.')[0]} library (pip install 'plait[data]'): {e}") from None


SUFFIXES = (".txt", ".jsonl", ".parquet")
TOKENIZER_KINDS = ("bytes", "hf", "tiktoken")


def list_inputs(paths: list[str]) -> list[Path]:
    return list(split_keys(paths))


def split_keys(paths: list[str]) -> dict[Path, str]:
    """The input files, in order, each with the name its documents' split is hashed under: the path
    from the folder that holds the ``--input`` argument (``corpus/sub/a.jsonl`` for a file found under
    ``--input corpus``; ``sub/a.jsonl`` for ``--input corpus/sub/a.jsonl``), so the split does not
    depend on the working directory or on how the path is spelled (relative, absolute, ``./``)."""
    files: dict[Path, str] = {}
    for p in map(Path, paths):
        if p.is_dir():
            top = Path(os.path.abspath(p))  # not resolve(): a symlinked folder keeps its own name
            for f in sorted(f for f in p.rglob("*") if f.suffix in SUFFIXES):
                files.setdefault(f, f"{top.name}/{f.relative_to(p).as_posix()}")
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise DataError(f"{p}: unsupported file type {p.suffix!r}; expected {', '.join(SUFFIXES)}")
            absolute = Path(os.path.abspath(p))
            files.setdefault(p, f"{absolute.parent.name}/{absolute.name}")
        else:
            raise DataError(f"{p}: no such file or folder")
    if not files:
        raise DataError(f"no {', '.join(SUFFIXES)} files under {', '.join(paths)}")
    return files


def documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        if path.suffix == ".txt":
            yield path.read_text(encoding="utf-8")
        elif path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            text = json.loads(line)[text_field]
                        except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
                            raise DataError(f"{path}:{n}: not a JSON object with a {text_field!r} string ({type(e).__name__}: {e})") from None
                        if not isinstance(text, str):
                            raise DataError(f"{path}:{n}: {text_field!r} is {type(text).__name__} {str(text)[:40]!r}, expected a string")
                        yield text
        else:
            need("pyarrow.parquet", f"{path}: reading .parquet")
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(path)
                if text_field not in pf.schema_arrow.names:
                    raise DataError(f"{path}: no column {text_field!r}; columns: {', '.join(pf.schema_arrow.names)}")
                batches = pf.iter_batches(columns=[text_field])
                for batch in batches:
                    for t in batch.column(0).to_pylist():
                        if t and not isinstance(t, str):
                            raise DataError(f"{path}: column {text_field!r} holds {type(t).__name__} values, expected strings")
                        if t:
                            yield t
            except DataError:
                raise
            except (pa.ArrowException, OSError, ValueError) as e:  # not a parquet file, corrupt pages
                raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


class Tokenizer:
    """bytes, hf:tokenizer.json or tiktoken:FILE, with an EOS id and a fingerprint. A bad spec, file or
    EOS id is a DataError naming ``where`` (the ``--tokenizer`` flag or the ``tokenizer`` key)."""

    def __init__(self, spec: str, eos_id: int | None, where: str = "tokenizer") -> None:
        self.spec = spec
        kind, _, path = spec.partition(":")
        if kind not in TOKENIZER_KINDS or (kind == "bytes") != (not path):
            raise DataError(f"{where} {spec!r}: expected bytes, hf:PATH/tokenizer.json or tiktoken:PATH")
        if kind == "bytes":
            if eos_id not in (None, 256):
                raise DataError(f"--eos-id {eos_id}: the bytes tokenizer's EOS is always 256")
            self.vocab_size, self.eos_id, self.fingerprint = 257, 256, "bytes"
            self._encode = lambda text: list(text.encode("utf-8"))
            self._encode_many = lambda texts: [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
            return
        file = Path(path)
        if not file.is_file():
            rel = "" if file.is_absolute() else f" (a relative path is taken from the working directory, {Path.cwd()})"
            raise DataError(f"{where} {spec!r}: {file} not found{rel}")
        try:
            data = read_tokenizer_file(file)  # a regular file of a tokenizer's size, never a device or a sparse image
        except OSError as e:
            raise DataError(f"{where} {spec!r}: {file} unreadable ({type(e).__name__}: {e.strerror or e})") from None
        self.fingerprint = hashlib.sha256(data).hexdigest()
        if kind == "hf":
            need("tokenizers", f"{where} {spec!r}")
            from tokenizers import Tokenizer as HFTokenizer

            try:
                tok = HFTokenizer.from_str(data.decode("utf-8"))
            except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
                raise DataError(f"{where} {spec!r}: {file} is not a tokenizers JSON file ({e})") from None
            self.vocab_size = tok.get_vocab_size()
            eos = eos_id
            if eos is None:
                for name in ("<|endoftext|>", "</s>", "<|end_of_text|>", "[EOS]", "<eos>"):
                    eos = tok.token_to_id(name)
                    if eos is not None:
                        break
            if eos is None:
                raise DataError(f"{where} {spec!r}: no EOS token found; pass --eos-id")
            if not 0 <= eos < self.vocab_size:
                raise DataError(f"--eos-id {eos}: outside the ids of {where} {spec!r}, expected 0 to {self.vocab_size - 1}")
            self.eos_id = eos
            self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
            self._encode_many = lambda texts: [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(texts, add_special_tokens=False)]
        else:
            import base64

            need("tiktoken", f"{where} {spec!r}")
            import tiktoken

            try:
                ranks = {
                    base64.b64decode(token, validate=True): int(rank) for token, rank in (line.split() for line in data.decode("utf-8").splitlines() if line)
                }
            except ValueError as e:  # a line that is not "base64 rank" (binascii.Error and UnicodeDecodeError included)
                raise DataError(f"{where} {spec!r}: {file} is not a tiktoken ranks file of 'base64 rank' lines ({e})") from None
            if not ranks:
                raise DataError(f"{where} {spec!r}: {file} holds no 'base64 rank' lines")
            if eos_id is None:
                eos_id = len(ranks)
            elif not 0 <= eos_id < 2**32:  # tiktoken's ids are 32-bit
                raise DataError(f"--eos-id {eos_id}: expected a token id from 0 to {2**32 - 1}")
            elif eos_id in ranks.values():
                raise DataError(f"--eos-id {eos_id}: already the id of a token of {where} {spec!r}; expected an id of its own (default {len(ranks)})")
            enc = tiktoken.Encoding(
                name=file.stem,
                pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                mergeable_ranks=ranks,
                special_tokens={"<|endoftext|>": eos_id},
            )
            self.vocab_size, self.eos_id = max(len(ranks), eos_id + 1), eos_id
            self._encode = lambda text: enc.encode_ordinary(text)
            self._encode_many = lambda texts: [np.asarray(enc.encode_ordinary(t), dtype=np.int64) for t in texts]

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text (without EOS), as integer arrays: the preparation's fast path."""
        return self._encode_many(texts)


CHUNK_BYTES = 1 << 20  # input bytes per task handed to a worker
INFLIGHT_PER_WORKER = 2  # tasks queued per worker: bounds the memory the pipeline holds

# A task: (path, kind, first line, first document, items, input bytes it stands for).
# kind "jsonl": items are raw lines; "txt": one item, the file's bytes; "text": strings (parquet rows).
Task = tuple[str, str, int, int, list, float]


def check_parquet(files: list[Path], text_field: str) -> None:
    """Every parquet input is readable and has the text column: refused before any tokenization."""
    parquets = [f for f in files if f.suffix == ".parquet"]
    if not parquets:
        return
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{parquets[0]}: reading .parquet needs pyarrow (pip install pyarrow, or plait[data])") from None
    for f in parquets:
        try:
            names = pq.ParquetFile(f).schema_arrow.names
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DataError(f"{f}: not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        if text_field not in names:
            raise DataError(f"{f}: no column {text_field!r} (--text-field); columns present: {', '.join(names) or 'none'}")


def read_tasks(path: Path, text_field: str, chunk_bytes: int) -> Iterator[Task]:
    """The file in tasks of about ``chunk_bytes`` input bytes, in document order. Only the task
    being filled is held, so memory does not grow with the file (a .txt file is one document)."""
    name = str(path)
    try:
        if path.suffix == ".txt":
            data = path.read_bytes()
            yield name, "txt", 1, 0, [data], float(len(data))
        elif path.suffix == ".jsonl":
            with path.open("rb") as f:
                lines: list[bytes] = []
                size, first_line, first_doc = 0, 1, 0
                for n, line in enumerate(f, 1):
                    if not lines:
                        first_line = n
                    lines.append(line)
                    size += len(line)
                    if size >= chunk_bytes:
                        yield name, "jsonl", first_line, first_doc, lines, float(size)
                        first_doc += sum(1 for line in lines if not line.isspace())
                        lines, size = [], 0
                if lines:
                    yield name, "jsonl", first_line, first_doc, lines, float(size)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(path)
                rows_total, file_bytes = max(pf.metadata.num_rows, 1), path.stat().st_size
                texts: list = []
                size = rows = first_doc = 0
                for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
                    for t in batch.column(0).to_pylist():
                        rows += 1
                        if not t:
                            continue  # null and empty rows are not documents
                        texts.append(t)
                        size += len(t) if isinstance(t, str) else 1
                        if size >= chunk_bytes:
                            yield name, "text", 0, first_doc, texts, file_bytes * rows / rows_total
                            first_doc += len(texts)
                            texts, size, rows = [], 0, 0
                if texts or rows:
                    yield name, "text", 0, first_doc, texts, file_bytes * rows / rows_total
            except (pa.ArrowException, ValueError) as e:  # corrupt pages
                raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    except OSError as e:
        raise DataError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


_TOKENIZER: Tokenizer | None = None


def _init(spec: str, eos_id: int | None) -> None:
    """A worker's tokenizer. One process is one core: the ``tokenizers`` library's own threads stay off."""
    global _TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _TOKENIZER = Tokenizer(spec, eos_id)


def _texts(task: Task, text_field: str) -> tuple[list[int], list[str]]:
    """(document numbers, texts) of a task; bad lines and values are one DataError naming file and line."""
    path, kind, first_line, first_doc, items, _ = task
    if kind == "txt":
        try:
            return [0], [items[0].decode("utf-8")]
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if kind == "text":
        for t in items:
            if not isinstance(t, str):
                raise DataError(f"{path}: column {text_field!r} holds {type(t).__name__} values, expected strings")
        return list(range(first_doc, first_doc + len(items))), items
    numbers: list[int] = []
    texts: list[str] = []
    for n, line in enumerate(items, first_line):
        if line.isspace():
            continue
        try:
            text = json.loads(line)[text_field]
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{n}: unreadable ({type(e).__name__}: {e})") from None
        except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
            raise DataError(f"{path}:{n}: not a JSON object with a {text_field!r} string ({type(e).__name__}: {e})") from None
        if not isinstance(text, str):
            raise DataError(f"{path}:{n}: {text_field!r} is {type(text).__name__} {str(text)[:40]!r}, expected a string")
        numbers.append(first_doc + len(numbers))
        texts.append(text)
    return numbers, texts


def is_val(name: str, number: int, val_fraction: float) -> bool:
    """Document ``number`` of the file named ``name`` (its :func:`split_keys` name) goes to
    validation: a hash of both, so every run agrees."""
    key = int.from_bytes(hashlib.blake2b(f"{name}#{number}".encode(), digest_size=8).digest(), "little") / 2**64
    return key < val_fraction


def encode_task(task: Task, text_field: str, val_fraction: float, dtype: str, name: str | None = None) -> tuple[np.ndarray, np.ndarray, int, float]:
    """(train tokens, val tokens) of one task in the on-disk dtype, its documents and input bytes;
    ``name`` is the file's split key (default: its path). A pure function of the task: the output
    does not depend on which worker ran it."""
    tok = cast(Tokenizer, _TOKENIZER)  # set in every worker by _init()
    numbers, texts = _texts(task, text_field)
    keep = [(k, t) for k, t in zip(numbers, texts) if t.strip()]  # an empty document would only add an EOS
    eos = np.asarray([tok.eos_id], dtype=np.int64)
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for (k, _), ids in zip(keep, tok.encode_many([t for _, t in keep])):
        parts[is_val(name or task[0], k, val_fraction)] += [ids, eos]
    out = []
    for split in (False, True):
        ids = np.concatenate(parts[split]).astype(np.int64, copy=False) if parts[split] else np.zeros(0, dtype=np.int64)
        if len(ids) and int(ids.max()) >= tok.vocab_size:
            raise DataError(f"{task[0]}: the tokenizer produced id {int(ids.max())} >= its vocab size {tok.vocab_size}")
        out.append(ids.astype(dtype))
    return out[0], out[1], len(keep), task[5]


def _encode_job(job: tuple[Task, str, float, str, str]) -> tuple[np.ndarray, np.ndarray, int, float]:
    return encode_task(*job)


def _clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "--:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """The progress bar on stderr: bytes read of the input, documents, tokens, tokens/s and ETA.

    On a terminal one line is redrawn every ``interval`` seconds (default 0.2); elsewhere (a log
    file, a pipe) a full line is printed every ``interval`` seconds (default 10). The ETA is the
    input bytes left at the rate the bytes so far were read."""

    WIDTH = 20

    def __init__(self, total_bytes: int, files: int, interval: float | None = None, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval = interval if interval is not None else (0.2 if self.tty else 10.0)
        self.total, self.files = max(total_bytes, 1), files
        self.t0 = time.perf_counter()
        self.last = -math.inf
        self.drawn = False

    def update(self, done_bytes: float, docs: int, tokens: int, file_no: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < self.interval:
            return
        self.last = now
        elapsed = max(now - self.t0, 1e-9)
        frac = min(done_bytes / self.total, 1.0)
        filled = int(frac * self.WIDTH)
        eta = elapsed * (1 - frac) / frac if frac > 0 else None
        line = (
            f"prepare [{'#' * filled}{'.' * (self.WIDTH - filled)}] {frac:6.1%} {done_bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB"
            f" | file {file_no}/{self.files} | {docs:,} docs | {tokens:,} tokens | {tokens / elapsed:,.0f} tokens/s"
            f" | {_clock(elapsed)} elapsed, ETA {_clock(eta)}"
        )
        self.stream.write(f"\r{line}\x1b[K" if self.tty else f"{line}\n")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def sources_fingerprint(files: list[Path]) -> list[dict]:
    return [{"path": str(f), "bytes": f.stat().st_size, "mtime": int(f.stat().st_mtime)} for f in files]


def finished(out: Path, settings: dict) -> dict | None:
    """The ``meta.json`` of a complete earlier preparation of ``out`` with these settings, else None
    (nothing there, other settings, a ``meta.json`` cut short or not an object, or files whose sizes
    are not the token counts it wrote): then the preparation runs again."""
    try:
        old = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(old, dict) or {k: old.get(k) for k in settings} != settings or not isinstance(old.get("tokens"), dict):
        return None
    itemsize = np.dtype(settings["dtype"]).itemsize
    for split in ("train", "val"):
        f, count = out / f"{split}.bin", old["tokens"].get(split)
        size = f.stat().st_size if f.is_file() else 0
        if not isinstance(count, int) or size != count * itemsize:
            return None
    return old


def prepare(args: argparse.Namespace) -> dict:
    keys = split_keys(args.input)
    files = list(keys)
    check_parquet(files, args.text_field)
    tok = Tokenizer(args.tokenizer, args.eos_id, "--tokenizer")
    dtype = args.dtype if args.dtype != "auto" else ("uint16" if tok.vocab_size <= 2**16 else "uint32")
    if tok.vocab_size > np.iinfo(dtype).max + 1:
        raise DataError(f"--dtype {dtype}: the tokenizer has {tok.vocab_size} ids, more than {dtype} holds; use uint32")
    out = Path(args.out)
    settings = {
        "tokenizer": args.tokenizer,
        "tokenizer_fingerprint": tok.fingerprint,
        "dtype": dtype,
        "val_fraction": args.val_fraction,
        "text_field": args.text_field,
        "sources": sources_fingerprint(files),
    }
    meta_path = out / "meta.json"
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out}: is a file, expected a folder")
    old = finished(out, settings)
    if old is not None:
        print(f"{out}: already prepared from the same inputs and settings; nothing to do", file=sys.stderr)
        return old
    tmp = {split: out / f"{split}.bin.tmp" for split in ("train", "val")}
    try:
        out.mkdir(parents=True, exist_ok=True)
        handles = {split: path.open("wb") for split, path in tmp.items()}
    except OSError as e:
        raise DataError(f"--out {out}: cannot create the folder or write in it ({type(e).__name__}: {e.strerror or e}); expected a writable folder") from None
    total_bytes = sum(f.stat().st_size for f in files)
    workers = max(1, args.workers)
    chunk_bytes = getattr(args, "chunk_bytes", CHUNK_BYTES)
    progress = Progress(total_bytes, len(files), getattr(args, "progress_interval", None))
    counts = {"train": 0, "val": 0}
    docs, done_bytes, file_no = 0, 0.0, 0

    def jobs() -> Iterator[tuple[int, tuple[Task, str, float, str, str]]]:
        for n, f in enumerate(files, 1):
            for task in read_tasks(f, args.text_field, chunk_bytes):
                yield n, (task, args.text_field, args.val_fraction, dtype, keys[f])

    def write(n: int, result: tuple[np.ndarray, np.ndarray, int, float]) -> None:
        nonlocal docs, done_bytes, file_no
        train, val, d, nbytes = result
        for split, ids in (("train", train), ("val", val)):
            ids.tofile(handles[split])
            counts[split] += len(ids)
        docs, done_bytes, file_no = docs + d, done_bytes + nbytes, n
        progress.update(done_bytes, docs, counts["train"] + counts["val"], n)

    pool = None
    try:
        if workers == 1:  # in this process: the same function, no pickling
            _init(args.tokenizer, args.eos_id)
            for n, job in jobs():
                write(n, _encode_job(job))
        else:  # results are written in input order, whichever worker finishes first: deterministic
            pool = ProcessPoolExecutor(
                max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init, initargs=(args.tokenizer, args.eos_id)
            )
            pending: deque = deque()
            for n, job in jobs():
                pending.append((n, pool.submit(_encode_job, job)))
                if len(pending) >= INFLIGHT_PER_WORKER * workers:
                    n_done, future = pending.popleft()
                    write(n_done, future.result())
            while pending:
                n_done, future = pending.popleft()
                write(n_done, future.result())
        progress.update(done_bytes, docs, counts["train"] + counts["val"], file_no, final=True)
    except BaseException:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
            pool = None
        for split, h in handles.items():
            h.close()
            tmp[split].unlink(missing_ok=True)
        raise
    finally:
        progress.close()
        if pool is not None:
            pool.shutdown()
    for h in handles.values():
        h.close()
    if docs == 0 or counts["train"] == 0:
        for split in handles:
            tmp[split].unlink(missing_ok=True)
        raise DataError(f"no text found in {', '.join(args.input)} (empty input)")
    meta_path.unlink(missing_ok=True)  # first: a run killed while renaming leaves no meta.json to vouch for the files
    os.replace(tmp["train"], out / "train.bin")
    if counts["val"]:
        os.replace(tmp["val"], out / "val.bin")
    else:  # no validation split: no empty val.bin (token_bin would refuse it), nor one left from an earlier run
        tmp["val"].unlink()
        (out / "val.bin").unlink(missing_ok=True)
    elapsed = time.perf_counter() - progress.t0
    meta = {
        **settings,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "documents": docs,
        "tokens": counts,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(sum(counts.values()) / elapsed),
        "mb_per_s": round(total_bytes / 1e6 / elapsed, 2),
        "workers": workers,
    }
    meta_tmp = out / "meta.json.tmp"
    meta_tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(meta_tmp, meta_path)  # last, and whole: a meta.json means the files beside it are complete
    print(
        f"prepare: {sum(counts.values()):,} tokens ({counts['val']:,} val) from {docs:,} documents in {elapsed:.1f} s: "
        f"{meta['tokens_per_s']:,} tokens/s, {meta['mb_per_s']} MB/s, {workers} worker(s)",
        file=sys.stderr,
    )
    return meta


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m plugins.data.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="files or folders (.txt, .jsonl, .parquet)")
    p.add_argument("--out", required=True, help="folder for train.bin, val.bin, meta.json")
    p.add_argument("--tokenizer", default="bytes", help="bytes | hf:PATH/tokenizer.json | tiktoken:PATH")
    p.add_argument("--eos-id", type=int, default=None, help="EOS id (default: the tokenizer's)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of documents (by hash) that go to val.bin")
    p.add_argument(
        "--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="tokenizer processes (default: CPUs - 1); the output is the same for any number"
    )
    p.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto")
    p.add_argument("--text-field", default="text", help="jsonl key / parquet column holding the text")
    p.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES, help="input bytes per task handed to a worker (default 1 MiB)")
    p.add_argument("--progress-interval", type=float, default=None, help="seconds between progress updates (default: 0.2 on a terminal, 10 in a log)")
    args = p.parse_args(argv)
    if not 0 <= args.val_fraction < 1:
        p.error(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.workers < 1 or args.chunk_bytes < 1:
        p.error(f"--workers and --chunk-bytes must be >= 1, got {args.workers} and {args.chunk_bytes}")
    if args.progress_interval is not None and args.progress_interval < 0:
        p.error(f"--progress-interval must be >= 0, got {args.progress_interval}")
    try:
        prepare(args)
    except PlaitError as e:
        exit_bad_input(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
