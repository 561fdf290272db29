"""Downstream evaluation cost: seconds for one pass over N multiple-choice examples (``core.loop.evaluation``).

The examples are synthetic, shaped like HellaSwag's (a context, four continuations) in bytes
tokens: ``--context`` and ``--continuation`` bytes each. The model is the flavor's shapes at
random init (the cost does not depend on the weights). One process, the ``Scorer`` the
``downstream`` monitor and ``core.eval`` use; the first pass is a warm-up and is not counted.

    python -m bench.eval_pass --flavor debug 50m --examples 1000 [--device cpu] [--record]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.common import report, table
from core.loop import evaluation
from model_specs.llama3.spec import Llama3Spec


def synthetic_task(n: int, context: int, continuation: int, seed: int = 0) -> evaluation.Task:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "

    def text(k: int) -> str:
        return "".join(rng.choice(letters) for _ in range(k))

    examples = [evaluation.Example(text(context), tuple(text(continuation) for _ in range(4)), rng.randrange(4), i + 1) for i in range(n)]
    return evaluation.Task("synthetic", evaluation.Path("synthetic.jsonl"), examples)


def measure(flavor: str, examples: int, context: int, continuation: int, batch_size: int, device: str, repeats: int) -> dict:
    spec = Llama3Spec.from_flavor(flavor)
    with torch.device(device):
        model = spec.build()
        spec.init_weights(model)
    task = synthetic_task(examples, context, continuation)
    prepared = evaluation.prepare([task], [], lambda s: list(s.encode("utf-8")), 256, spec.vocab_size)
    scorer = evaluation.Scorer(model, context + continuation, device, batch_size)
    warm = evaluation.prepare([synthetic_task(batch_size, context, continuation, seed=1)], [], lambda s: list(s.encode("utf-8")), 256, spec.vocab_size)
    evaluation.evaluate_locally(warm, scorer)
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        evaluation.evaluate_locally(prepared, scorer)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tokens = examples * 4 * (context + continuation)
    best = min(times)
    return {"flavor": flavor, "examples": examples, "s": best, "median_s": statistics.median(times), "tokens_per_s": tokens / best}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", nargs="+", default=["debug", "50m"])
    p.add_argument("--examples", type=int, default=1000)
    p.add_argument("--context", type=int, default=96, help="context bytes (tokens) per example")
    p.add_argument("--continuation", type=int, default=32, help="bytes (tokens) per continuation")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--record", action="store_true", help="append the figures to bench/results.jsonl")
    args = p.parse_args()
    rows = []
    for flavor in args.flavor:
        r = measure(flavor, args.examples, args.context, args.continuation, args.batch_size, args.device, args.repeats)
        rows.append([r["flavor"], r["examples"], r["s"], r["median_s"], r["tokens_per_s"]])
        print(r, flush=True)
    body = table(["flavor", "examples", "best s", "median s", "tokens/s scored"], rows)
    print(body)
    if args.record:
        note = (
            f"{args.examples} synthetic 4-choice examples, {args.context}-token contexts and {args.continuation}-token continuations (bytes), "
            f"batch {args.batch_size} sequences, fp32, random init; {args.repeats} timed pass(es) after a warm-up"
        )
        report(f"Downstream evaluation pass: {', '.join(args.flavor)} on {args.device}", body, device=args.device, note=note)


if __name__ == "__main__":
    main()
