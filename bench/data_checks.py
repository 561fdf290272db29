"""The cost of token_bin's safety checks on a multi-GB token file (docs/reliability.md, issue 34).

Two costs, on a generated file of random uint16 ids (deleted afterwards):

* the start-up checks of ``TokenBin.validate``: the scan of every id against the model's and
  ``meta.json``'s vocabulary, and the uint32-read-as-uint16 look at the first 65,536 tokens;
* the reads while training: windows through ``pread`` with the file's size and time checked on
  each read (``TokenFile``, which ends a file truncated under the run in one line), against the same
  windows sliced from a memory map (which a truncated file kills with SIGBUS), through the loader
  the trainer uses, on one CPU thread.

    python -m bench.data_checks --gib 2 --seq-len 2048 --micro-batch 8 --batches 400
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import loader_rate, report, table


def make_file(folder: Path, gib: float, vocab: int) -> Path:
    """``train.bin`` of ``gib`` GiB of random uint16 ids below ``vocab``, and its ``meta.json``."""
    n = int(gib * 2**30) // 2
    rng = np.random.default_rng(0)
    chunk = 1 << 26
    with open(folder / "train.bin", "wb") as f:
        for start in range(0, n, chunk):
            rng.integers(0, vocab, min(chunk, n - start), dtype=np.uint16).tofile(f)
    (folder / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": vocab, "tokens": {"train": n}}))
    return folder / "train.bin"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the file is made (default: the temporary folder)")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    vocab = 50_000

    class MappedTokenBin(TokenBin):
        """The same source, its windows sliced from a memory map."""

        def sample(self, index: int, seq_len: int, split: str) -> np.ndarray:
            from core.api import mix_seed
            from plugins.data.token_bin import SPLIT_IDS

            if split not in self.mapped:
                self.mapped[split] = np.memmap(self.file(split), dtype=self.dtype(), mode="r")
            arr = self.mapped[split]
            start = mix_seed(self.seed, SPLIT_IDS[split], index) % (len(arr) - seq_len - 1)
            return np.asarray(arr[start : start + seq_len + 1], dtype=np.int64)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        f = make_file(folder, args.gib, vocab)
        made_s = time.perf_counter() - t0
        size = f.stat().st_size
        scans, width = [], []
        for _ in range(args.repeats):
            source = TokenBin(TokenBinOptions(path=str(folder)))
            t0 = time.perf_counter()
            source.check_ids(f, np.dtype(np.uint16), size // 2, vocab)
            scans.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            source.check_width(f, size // 2, vocab)
            width.append(time.perf_counter() - t0)
        pread_rates, mapped_rates = [], []
        for _ in range(args.repeats):
            mapped = MappedTokenBin(TokenBinOptions(path=str(folder)))
            mapped.mapped = {}
            mapped_rates.append(loader_rate(mapped, args.seq_len, args.micro_batch, args.batches, vocab))
            checked = TokenBin(TokenBinOptions(path=str(folder)))
            checked.validate(vocab, args.seq_len)
            pread_rates.append(loader_rate(checked, args.seq_len, args.micro_batch, args.batches, vocab))
    scan_s = statistics.median(scans)
    rows = [
        ["start: id scan (check_ids), s", scan_s],
        ["start: id scan, GB/s", size / scan_s / 1e9],
        ["start: uint32-as-uint16 look (check_width), ms", statistics.median(width) * 1e3],
        ["loader: memory-mapped windows, tokens/s", statistics.median(mapped_rates)],
        ["loader: pread + size/time check (TokenFile), tokens/s", statistics.median(pread_rates)],
        ["loader: pread + check / memory-mapped", statistics.median(pread_rates) / statistics.median(mapped_rates)],
    ]
    body = table(["measure", "median"], rows)
    body += (
        f"\n\nA generated file of {size / 2**30:.2f} GiB ({size // 2:,} uint16 ids, made in {made_s:.1f} s and deleted after; "
        f"page-cached as just written), {args.repeats} repeats each; loader: micro-batch {args.micro_batch} x seq "
        f"{args.seq_len}, {args.batches} batches, random windows, one thread."
    )
    print(body)
    if not args.no_record:
        report("Data checks: id scan and checked reads (token_bin)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
