"""Which part of plait's loop costs host time on CUDA: the hand loop of :mod:`bench.overhead` against
plait as it is, without the prefetching thread, without the non-finite guard, and without both.

The ``debug`` flavor at bf16 does about 2 ms of GPU work per step, so its step
time is the host's: launching kernels and the loop's own Python. Five
alternating rounds of 60 steps each; medians and every round.

    python -m bench.overhead_parts
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def no_thread(loader, accum, device, force_thread=False):
    """Stands in for core.data.prefetch.prefetching: the loop reads the loader itself."""
    return loader


def build(args, prefetch_thread: bool, guard: bool):
    import core.loop.assemble
    import core.loop.trainer
    from bench import overhead
    from bench.guard_cost import NoGuard
    from core.data import prefetch

    chosen = prefetch.prefetching if prefetch_thread else no_thread
    core.loop.assemble.prefetching = core.loop.trainer.prefetching = chosen  # type: ignore[attr-defined]
    try:
        trainer = overhead.plait_trainer(args)
    finally:
        core.loop.assemble.prefetching = core.loop.trainer.prefetching = prefetch.prefetching  # type: ignore[attr-defined]
    if not guard:
        trainer.stepper.guard = NoGuard(torch.zeros((), device=args.device))
    return trainer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.overhead_parts: needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    from bench import overhead

    shape = argparse.Namespace(flavor="debug", seq_len=512, micro_batch=8, accum=2, steps=args.steps, device="cuda", precision="bf16")
    base = build(shape, prefetch_thread=True, guard=True)
    loops = {
        "hand": overhead.HandLoop(base, shape).time,
        "plait": base,
        "no-prefetch": build(shape, prefetch_thread=False, guard=True),
        "no-guard": build(shape, prefetch_thread=True, guard=False),
        "no-prefetch-no-guard": build(shape, prefetch_thread=False, guard=False),
    }
    run = {k: (v if callable(v) else (lambda n, t=v: overhead.time_plait(t, n))) for k, v in loops.items()}
    for f in run.values():
        f(10)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in run}
    for _ in range(args.rounds):
        for k, f in run.items():
            times[k].append(f(args.steps) * 1000)
    for k, v in times.items():
        print(f"{k:22s} median {statistics.median(v):6.2f} ms  {[round(x, 2) for x in v]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
