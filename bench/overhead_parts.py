"""Which part of plait's loop costs host time on CUDA: the hand loop of :mod:`bench.overhead` against
plait as it is, without the prefetching thread, without the non-finite guard, and without both.

The ``debug`` flavor at bf16 does about 2 ms of GPU work per step, so its step
time is the host's: launching kernels and the loop's own Python. Five
alternating rounds of 60 steps each; medians and every round.

    python -m bench.overhead_parts
"""

import argparse
import statistics
import sys

import torch

import core.assemble as A
import core.trainer as T
from bench import overhead
from bench.guard_cost import NoGuard
from dataloading import prefetch

if not torch.cuda.is_available():
    print("bench.overhead_parts: needs a CUDA device; torch sees none", file=sys.stderr)
    sys.exit(2)
args = argparse.Namespace(flavor="debug", seq_len=512, micro_batch=8, accum=2, steps=60, device="cuda", precision="bf16")
base = overhead.plait_trainer(args)
hand = overhead.HandLoop(base, args)


def no_thread(loader, accum, device, force_thread=False):
    return loader


A.prefetching = T.prefetching = no_thread
noprefetch = overhead.plait_trainer(args)
A.prefetching = T.prefetching = prefetch.prefetching
noguard = overhead.plait_trainer(args)
noguard.stepper.guard = NoGuard(torch.zeros((), device="cuda"))
A.prefetching = T.prefetching = no_thread
both = overhead.plait_trainer(args)
both.stepper.guard = NoGuard(torch.zeros((), device="cuda"))
print(
    "optimizer",
    type(base.optimizer).__name__,
    base.optimizer.defaults.get("fused"),
    base.optimizer.defaults.get("foreach"),
    "loader",
    type(base.loader).__name__,
    type(noprefetch.loader).__name__,
)
cands = {
    "hand": hand.time,
    "plait": lambda n: overhead.time_plait(base, n),
    "no-prefetch": lambda n: overhead.time_plait(noprefetch, n),
    "no-guard": lambda n: overhead.time_plait(noguard, n),
    "no-prefetch-no-guard": lambda n: overhead.time_plait(both, n),
}
for f in cands.values():
    f(10)
res = {k: [] for k in cands}
for _ in range(5):
    for k, f in cands.items():
        res[k].append(f(args.steps) * 1000)
for k, v in res.items():
    print(f"{k:22s} median {statistics.median(v):6.2f} ms  {[round(x, 2) for x in v]}")
