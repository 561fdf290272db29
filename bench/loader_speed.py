"""Loader throughput: tokens/s delivered by token_bin and by a 4-source mixture, on one CPU thread.

Draws micro-batches through the same loader the trainer uses (global index
layout, memory-mapped windows, int64 tensors), with ``torch.set_num_threads(1)``.

    python -m bench.loader_speed --seq-len 2048 --micro-batch 8 --batches 400
"""

from __future__ import annotations

import argparse
import sys

from bench.common import REPO, loader_rate, report, table

CORPUS = REPO / "plugins" / "data" / "corpus" / "shakespeare"


def rate(source, seq_len: int, micro: int, batches: int) -> float:
    source.validate(512, seq_len)
    return loader_rate(source, seq_len, micro, batches)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from plugins.data.mixture import Mixture, MixtureOptions
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    weights = [0.45, 0.25, 0.2, 0.1]

    def mixture(order: str) -> Mixture:
        return Mixture(MixtureOptions(sources=[{"name": "token_bin", "weight": w, "path": str(CORPUS), "order": order} for w in weights]))

    rows = [
        ["token_bin, order random", rate(TokenBin(TokenBinOptions(path=str(CORPUS))), args.seq_len, args.micro_batch, args.batches)],
        ["token_bin, order epochs", rate(TokenBin(TokenBinOptions(path=str(CORPUS), order="epochs")), args.seq_len, args.micro_batch, args.batches)],
        ["mixture of 4 token_bin, order random", rate(mixture("random"), args.seq_len, args.micro_batch, args.batches)],
        ["mixture of 4 token_bin, order epochs", rate(mixture("epochs"), args.seq_len, args.micro_batch, args.batches)],
    ]
    body = table(["source", "tokens/s (one thread)"], rows)
    body += f"\n\nmicro-batch {args.micro_batch} x seq {args.seq_len}, {args.batches} batches, shipped Shakespeare corpus (page-cached)."
    print(body)
    if not args.no_record:
        report("Loader throughput", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
