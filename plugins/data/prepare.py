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
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np

from core.api import ArgumentParser, DataError, PlaitError, Tokenizer, exit_bad_input
from plugins.data.prepare_progress import Progress
from plugins.data.prepare_tasks import CHUNK_BYTES, INFLIGHT_PER_WORKER, Task, encode_job, read_tasks, start_worker
from plugins.data.text_inputs import check_parquet, documents, split_keys

__all__ = ["Tokenizer", "documents", "main", "prepare"]  # Tokenizer and documents: text_stream imports them from here


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
            start_worker(args.tokenizer, args.eos_id)
            for n, job in jobs():
                write(n, encode_job(job))
        else:  # results are written in input order, whichever worker finishes first: deterministic
            pool = ProcessPoolExecutor(
                max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=start_worker, initargs=(args.tokenizer, args.eos_id)
            )
            pending: deque = deque()
            for n, job in jobs():
                pending.append((n, pool.submit(encode_job, job)))
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


def parser() -> ArgumentParser:
    """The command's flags (docs' flag tables are generated from it: core.cli.doc_tables)."""
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
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
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
