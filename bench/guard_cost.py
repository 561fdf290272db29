"""Cost of the per-step non-finite guard (core/loop/nonfinite.py): plait's train_step with and without it.

One process, the same Trainer and batches; "without" replaces the guard's
check with a constant and calls ``optimizer.step()`` directly. The two
alternate in rounds and the medians are compared.

    python -m bench.guard_cost --flavor debug --steps 20 --rounds 5
    python -m bench.guard_cost --device cuda --flavor 1b --seq-len 2048 --micro-batch 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.common import report, synthetic_config, table


class NoGuard:
    """Stands in for NonFiniteGuard: no check, the update always applied."""

    on_device = False

    def __init__(self, zero):
        self.zero = zero

    def flag(self, loss, grad_norm):
        return self.zero

    def step(self, optimizer, bad):
        optimizer.step()

    def read(self):
        """(skipped, worst run, skipping now): never any."""
        return 0, 0, 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--optimizer-impl", default="auto", choices=["auto", "fused", "foreach"])
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.guard_cost: --device cuda asked, but torch sees no CUDA device", file=sys.stderr)
        return 2
    from core.contract.protocols import DistInfo
    from core.loop.trainer import Trainer
    from core.preflight.prepare import prepare

    extra = {"vocab_size": 512} if args.flavor == "debug" else {}
    cfg = synthetic_config(args.flavor, args.seq_len, args.micro_batch, args.device, "/tmp/plait-bench-guard", **extra)
    prep = prepare(str(cfg), [f"--optimizer.impl={args.optimizer_impl}", f"--train.steps={10**6}"], world_size=1)
    t = Trainer(prep, DistInfo(device=torch.device(args.device)))
    t.build()
    guard, bare = t.guard, NoGuard(torch.zeros((), device=args.device))
    batches = iter(t.loader)
    micro = t.fetch.fetch(batches, t.built.loader_spec)[0]

    def timed(g) -> float:
        t.stepper.guard = g  # the step's guard (Trainer.guard reads it)
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            t.train_step(micro)
        sync()
        return (time.perf_counter() - t0) / args.steps

    timed(guard), timed(bare)  # warm-up
    with_g, without = [], []
    for _ in range(args.rounds):
        with_g.append(timed(guard))
        without.append(timed(bare))
    a, b = statistics.median(with_g), statistics.median(without)
    rows = [
        ["without the guard", b * 1000, f"{min(without) * 1000:.2f}-{max(without) * 1000:.2f}", 1.0],
        ["with the guard", a * 1000, f"{min(with_g) * 1000:.2f}-{max(with_g) * 1000:.2f}", a / b],
    ]
    body = table(["train_step", "median ms", "range ms", "ratio"], rows)
    body += (
        f"\n\nflavor `{args.flavor}`, seq {args.seq_len} x micro-batch {args.micro_batch}, one process, "
        f"optimizer skip on device: {guard.on_device} ({type(t.optimizer).__name__}, impl {args.optimizer_impl}); "
        f"{args.steps} steps x {args.rounds} alternating rounds."
    )
    print(body)
    if not args.no_record:
        report(f"Non-finite guard cost: {args.flavor} on {args.device}", body, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
