"""Where plait's loop and the hand loop of :mod:`bench.overhead` spend a CUDA step: host syncs and ops.

Both run ``--warmup`` steps, then ``--steps`` steps under ``torch.profiler``
(CPU and CUDA activity). For each, the report lists the calls that make the
host wait for the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
``aten::_local_scalar_dense``, ``cudaMemcpyAsync``) per step, and the top ops by
self CPU time. Counts are exact; times are this run's.

    python -m bench.cuda_profile --steps 20
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench import overhead

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense", "cudaMemcpyAsync", "cudaEventSynchronize")


def profiled(run, steps: int, top: int) -> str:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(steps)
        torch.cuda.synchronize()
    avg = prof.key_averages()
    lines = [f"{name}: {sum(e.count for e in avg if e.key == name) / steps:.2f} per step" for name in SYNCS]
    lines.append(avg.table(sort_by="self_cpu_time_total", row_limit=top))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.cuda_profile: needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    args.device = "cuda"
    trainer = overhead.plait_trainer(args)
    hand = overhead.HandLoop(trainer, args)
    overhead.time_plait(trainer, args.warmup)
    hand.time(args.warmup)
    print("=== plait (fit over the steps, its per-run work included)")
    print(profiled(lambda n: overhead.time_plait(trainer, n), args.steps, args.top))
    print("=== hand loop")
    print(profiled(hand.time, args.steps, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
