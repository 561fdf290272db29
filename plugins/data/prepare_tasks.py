"""A data preparation's work: each input file read in tasks of about ``--chunk-bytes`` (only the
task being filled is held), and each task encoded, in a worker process or in this one, into train
and validation tokens in the on-disk dtype (a pure function of the task: the output does not depend
on which worker ran it). Documents go to validation by a hash of their file's split key and number."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator, cast

import numpy as np

from core.api import DataError, Tokenizer

CHUNK_BYTES = 1 << 20  # input bytes per task handed to a worker
INFLIGHT_PER_WORKER = 2  # tasks queued per worker: bounds the memory the pipeline holds

# A task: (path, kind, first line, first document, items, input bytes it stands for).
# kind "jsonl": items are raw lines; "txt": one item, the file's bytes; "text": strings (parquet rows).
Task = tuple[str, str, int, int, list, float]


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


def start_worker(spec: str, eos_id: int | None) -> None:
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
    tok = cast(Tokenizer, _TOKENIZER)  # set in every worker by start_worker()
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


def encode_job(job: tuple[Task, str, float, str, str]) -> tuple[np.ndarray, np.ndarray, int, float]:
    return encode_task(*job)
