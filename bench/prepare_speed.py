"""Data preparation throughput: tokens/s per worker of ``python -m plugins.data.prepare``.

Writes a jsonl of English documents (the shipped Shakespeare text cut into
documents of 2-6 KB, FineWeb-Edu's typical length), trains a byte-level BPE
on it here (no download), then prepares the file with 1 and 2 workers for the
``bytes`` tokenizer and the BPE, each as its own process. Reports tokens/s,
tokens/s per worker, MB/s and the peak RSS of the preparation and its workers,
and checks that every worker count wrote the same bytes.

    python -m bench.prepare_speed --mb 40 --workers 1 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.common import REPO, report, table

SHAKESPEARE = REPO / "plugins" / "data" / "corpus" / "shakespeare" / "train.bin"

MEASURE = """
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(proc.stderr[-2000:])
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(proc.returncode)
"""


def write_corpus(path: Path, megabytes: float) -> int:
    text = bytes(np.fromfile(SHAKESPEARE, dtype=np.uint16).astype(np.uint8)).decode("utf-8", "replace")
    rng = np.random.default_rng(0)
    written = docs = 0
    with path.open("w") as f:
        while written < megabytes * 1e6:
            start = int(rng.integers(0, len(text) - 8000))
            line = json.dumps({"id": docs, "text": text[start : start + int(rng.integers(2000, 6000))]}) + "\n"
            f.write(line)
            written += len(line.encode())
            docs += 1
    return docs


def train_bpe(corpus: Path, out: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = bytes(np.fromfile(SHAKESPEARE, dtype=np.uint16).astype(np.uint8)).decode("utf-8", "replace")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        text.split("\n\n"), trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tok.save(str(out))
    return out


def run(corpus: Path, out: Path, tokenizer: str, workers: int) -> tuple[dict, float, str]:
    cmd = [
        sys.executable,
        "-c",
        MEASURE,
        sys.executable,
        "-m",
        "plugins.data.prepare",
        "--input",
        str(corpus),
        "--out",
        str(out),
        "--tokenizer",
        tokenizer,
        "--workers",
        str(workers),
        "--progress-interval",
        "1000",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"prepare failed: {proc.stderr}")
    digest = hashlib.sha256((out / "train.bin").read_bytes() + (out / "val.bin").read_bytes()).hexdigest()
    return json.loads((out / "meta.json").read_text()), int(proc.stdout.split()[-1]) / 1024, digest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=40, help="size of the generated jsonl")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary trained for the run")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        docs = write_corpus(tmp / "corpus.jsonl", args.mb)
        size = (tmp / "corpus.jsonl").stat().st_size
        bpe = train_bpe(tmp / "corpus.jsonl", tmp / "tokenizer.json", args.vocab)
        for name, spec in (("bytes", "bytes"), (f"BPE {args.vocab} (tokenizers)", f"hf:{bpe}")):
            digests = set()
            for w in args.workers:
                meta, rss, digest = run(tmp / "corpus.jsonl", tmp / f"out_{len(rows)}", spec, w)
                digests.add(digest)
                tokens = meta["tokens"]["train"] + meta["tokens"]["val"]
                rows.append(
                    [
                        name,
                        w,
                        f"{tokens:,}",
                        f"{meta['seconds']:.2f}",
                        f"{meta['tokens_per_s']:,}",
                        f"{meta['tokens_per_s'] / w:,.0f}",
                        f"{meta['mb_per_s']:.2f}",
                        f"{rss:.0f}",
                    ]
                )
                print(rows[-1], flush=True)
            if len(digests) != 1:
                raise SystemExit(f"{name}: the worker counts {args.workers} wrote different files")
    load_after = os.getloadavg()
    body = table(["tokenizer", "workers", "tokens", "seconds", "tokens/s", "tokens/s per worker", "MB/s", "peak RSS MB"], rows)
    body += (
        f"\n\n{size / 1e6:.1f} MB jsonl, {docs:,} documents of 2-6 KB cut from the shipped Shakespeare text; "
        "every worker count wrote byte-identical files. Peak RSS: the largest of the preparation process and its workers."
    )
    import tokenizers

    note = (
        f"tokenizers {tokenizers.__version__}, numpy {np.__version__}; load average (1 min) {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after, on {os.cpu_count()} CPUs"
    )
    if max(load_before[0], load_after[0]) > (os.cpu_count() or 1) - 0.5:
        note += (
            ": other jobs were loading the machine, so the workers had no free core each and the figures for more than one worker show contention, not scaling"
        )
    print(body + "\n" + note)
    if not args.no_record:
        report("Data preparation throughput", body, note=note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
