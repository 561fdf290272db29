"""``python -m plugins.data.prepare``: tokenize text into nanoGPT's train.bin / val.bin.

    python -m plugins.data.prepare --input corpus/ more.jsonl --out data/mine \\
        --tokenizer hf:tokenizer.json --val-fraction 0.01 --workers 8

Inputs: ``.txt`` (one document per file), ``.jsonl`` (one document per line,
``--text-field``), ``.parquet`` (pyarrow, ``--text-field`` column), or
folders of them. Tokenizers: ``bytes`` (UTF-8 bytes, EOS 256),
``hf:PATH/tokenizer.json`` (the ``tokenizers`` library), or
``tiktoken:PATH.tiktoken`` (a BPE ranks file on disk, with ``--eos-id``).
EOS separates documents. Documents go to the validation split by a hash of
their position, so the split is deterministic. Re-running with the same
inputs and settings finds a matching ``meta.json`` and does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np

from core.errors import DataError, PlaitError, exit_bad_input

SUFFIXES = (".txt", ".jsonl", ".parquet")


def list_inputs(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.suffix in SUFFIXES)
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise DataError(f"{p}: unsupported file type {p.suffix!r}; expected {', '.join(SUFFIXES)}")
            files.append(p)
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
                            raise DataError(f"{path}:{n}: not a JSON object with a {text_field!r} string "
                                            f"({type(e).__name__}: {e})") from None
                        if not isinstance(text, str):
                            raise DataError(f"{path}:{n}: {text_field!r} is {type(text).__name__} {str(text)[:40]!r}, expected a string")
                        yield text
        else:
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
    """bytes, hf:tokenizer.json or tiktoken:FILE, with an EOS id and a fingerprint."""

    def __init__(self, spec: str, eos_id: int | None) -> None:
        self.spec = spec
        kind, _, path = spec.partition(":")
        if kind == "bytes":
            self.vocab_size, self.eos_id, self.fingerprint = 257, 256, "bytes"
            self._encode = lambda text: list(text.encode("utf-8"))
            return
        file = Path(path)
        if not file.is_file():
            raise DataError(f"--tokenizer {spec}: {file} not found")
        self.fingerprint = hashlib.sha256(file.read_bytes()).hexdigest()
        if kind == "hf":
            from tokenizers import Tokenizer as HFTokenizer

            tok = HFTokenizer.from_file(str(file))
            self.vocab_size = tok.get_vocab_size()
            eos = eos_id
            if eos is None:
                for name in ("<|endoftext|>", "</s>", "<|end_of_text|>", "[EOS]", "<eos>"):
                    eos = tok.token_to_id(name)
                    if eos is not None:
                        break
            if eos is None:
                raise DataError(f"--tokenizer {spec}: no EOS token found; pass --eos-id")
            self.eos_id = eos
            self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
        elif kind == "tiktoken":
            import base64

            import tiktoken

            ranks = {base64.b64decode(tokenb): int(rank) for tokenb, rank in (l.split() for l in file.read_text().splitlines() if l)}
            if eos_id is None:
                eos_id = len(ranks)
            enc = tiktoken.Encoding(name=file.stem, pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                                    mergeable_ranks=ranks, special_tokens={"<|endoftext|>": eos_id})
            self.vocab_size, self.eos_id = max(len(ranks), eos_id + 1), eos_id
            self._encode = lambda text: enc.encode_ordinary(text)
        else:
            raise DataError(f"--tokenizer {spec}: expected bytes, hf:PATH or tiktoken:PATH")

    def encode(self, text: str) -> list[int]:
        return self._encode(text)


_TOKENIZER: Tokenizer | None = None


def _init(spec: str, eos_id: int | None) -> None:
    global _TOKENIZER
    _TOKENIZER = Tokenizer(spec, eos_id)


def _encode_file(args: tuple[str, str, float]) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    path, text_field, val_fraction = args
    train, val, docs = [], [], 0
    for i, text in enumerate(documents(Path(path), text_field)):
        if not text or not text.strip():
            continue  # an empty document would only add an EOS
        ids = np.asarray(_TOKENIZER.encode(text) + [_TOKENIZER.eos_id], dtype=np.int64)
        key = int.from_bytes(hashlib.blake2b(f"{path}#{i}".encode(), digest_size=8).digest(), "little") / 2**64
        (val if key < val_fraction else train).append(ids)
        docs += 1
    return train, val, docs


def sources_fingerprint(files: list[Path]) -> list[dict]:
    return [{"path": str(f), "bytes": f.stat().st_size, "mtime": int(f.stat().st_mtime)} for f in files]


def prepare(args: argparse.Namespace) -> dict:
    files = list_inputs(args.input)
    tok = Tokenizer(args.tokenizer, args.eos_id)
    dtype = args.dtype if args.dtype != "auto" else ("uint16" if tok.vocab_size <= 2**16 else "uint32")
    if tok.vocab_size > np.iinfo(dtype).max + 1:
        raise DataError(f"--dtype {dtype}: the tokenizer has {tok.vocab_size} ids, more than {dtype} holds; use uint32")
    out = Path(args.out)
    settings = {"tokenizer": args.tokenizer, "tokenizer_fingerprint": tok.fingerprint, "dtype": dtype,
                "val_fraction": args.val_fraction, "text_field": args.text_field, "sources": sources_fingerprint(files)}
    meta_path = out / "meta.json"
    if meta_path.is_file() and (out / "train.bin").is_file():
        old = json.loads(meta_path.read_text())
        if {k: old.get(k) for k in settings} == settings:
            print(f"{out}: already prepared from the same inputs and settings; nothing to do", file=sys.stderr)
            return old
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    jobs = [(str(f), args.text_field, args.val_fraction) for f in files]
    counts = {"train": 0, "val": 0}
    docs = 0
    max_id = -1
    handles = {split: (out / f"{split}.bin.tmp").open("wb") for split in ("train", "val")}
    with ProcessPoolExecutor(max_workers=args.workers, initializer=_init, initargs=(args.tokenizer, args.eos_id)) as pool:
        for n, (train, val, d) in enumerate(pool.map(_encode_file, jobs), 1):  # in input order: deterministic
            docs += d
            for split, arrays in (("train", train), ("val", val)):
                for a in arrays:
                    max_id = max(max_id, int(a.max()))
                    a.astype(dtype).tofile(handles[split])
                    counts[split] += len(a)
            rate = (counts["train"] + counts["val"]) / max(time.perf_counter() - t0, 1e-9)
            print(f"\rprepare: {n}/{len(files)} files, {docs:,} documents, {rate:,.0f} tokens/s", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for h in handles.values():
        h.close()
    if docs == 0 or counts["train"] == 0:
        for split in handles:
            (out / f"{split}.bin.tmp").unlink(missing_ok=True)
        raise DataError(f"no text found in {', '.join(args.input)} (empty input)")
    if max_id >= tok.vocab_size:
        raise DataError(f"the tokenizer produced id {max_id} >= its vocab size {tok.vocab_size}")
    for split in handles:
        os.replace(out / f"{split}.bin.tmp", out / f"{split}.bin")
    elapsed = time.perf_counter() - t0
    total_bytes = sum(f.stat().st_size for f in files)
    meta = {**settings, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "documents": docs, "tokens": counts,
            "seconds": round(elapsed, 3), "tokens_per_s": round(sum(counts.values()) / elapsed), "mb_per_s": round(total_bytes / 1e6 / elapsed, 2)}
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"prepare: {sum(counts.values()):,} tokens ({counts['val']:,} val) from {docs:,} documents in {elapsed:.1f} s: "
          f"{meta['tokens_per_s']:,} tokens/s, {meta['mb_per_s']} MB/s", file=sys.stderr)
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m plugins.data.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="files or folders (.txt, .jsonl, .parquet)")
    p.add_argument("--out", required=True, help="folder for train.bin, val.bin, meta.json")
    p.add_argument("--tokenizer", default="bytes", help="bytes | hf:PATH/tokenizer.json | tiktoken:PATH")
    p.add_argument("--eos-id", type=int, default=None, help="EOS id (default: the tokenizer's)")
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto")
    p.add_argument("--text-field", default="text", help="jsonl key / parquet column holding the text")
    args = p.parse_args(argv)
    if not 0 <= args.val_fraction < 1:
        p.error("--val-fraction must be in [0, 1)")
    try:
        prepare(args)
    except PlaitError as e:
        exit_bad_input(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
