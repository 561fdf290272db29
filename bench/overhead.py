"""Framework overhead: plait's training loop vs a minimal hand-written PyTorch loop.

Both train the same model (built by plait's llama3 spec), on the same data
(the shipped Shakespeare corpus through memory-mapped random windows), with
the same AdamW, schedule, clipping and precision, on one process. The two
loops alternate in blocks, and the median step time of each is compared.

    python -m bench.overhead --flavor debug --steps 20 --repeats 3
    python -m bench.overhead --flavor 50m --steps 5 --repeats 3 --seq-len 256 --micro-batch 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from bench.common import REPO, report, table

CORPUS = REPO / "plugins" / "data" / "corpus" / "shakespeare"


def plait_trainer(args):
    from core.contract.protocols import DistInfo
    from core.loop.trainer import Trainer
    from core.preflight.prepare import prepare

    overrides = [
        f"--model.flavor={args.flavor}",
        "--model.vocab_size=512" if args.flavor == "debug" else "",
        f"--data.seq_len={args.seq_len}",
        f"--train.micro_batch={args.micro_batch}",
        f"--train.global_batch_tokens={args.micro_batch * args.seq_len * args.accum}",
        f"--train.steps={args.steps}",
        "--train.log_every=1000000",
        f"--train.device={args.device}",
        f"--precision.name={args.precision}",
        "--monitors.enabled=[]",
        "--checkpoint.at_end=false",
        "--checkpoint.resume=none",
        "--train.output_dir=/tmp/plait-bench-overhead",
        "--lr_schedule.warmup_steps=2",
        "--optimizer.lr=1e-4",
    ]
    prep = prepare(str(REPO / "train_configs" / "debug_cpu.toml"), [o for o in overrides if o])
    trainer = Trainer(prep, DistInfo(device=torch.device(args.device)))
    trainer.build()
    return trainer


def time_plait(trainer, steps: int) -> float:
    trainer.run.step = 0
    trainer.run.total_steps = steps
    t0 = time.perf_counter()
    trainer.fit()
    if trainer.dist.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


class HandLoop:
    """What a careful person writes by hand: no framework, same work."""

    def __init__(self, trainer, args) -> None:
        spec = trainer.c["model"]
        with torch.device("meta"):
            model = spec.build()
        model.to_empty(device=args.device)
        with torch.no_grad():
            spec.init_weights(model)
        self.model = model
        self.device = torch.device(args.device)
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embeddings" not in n]
        no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embeddings" not in n)]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=1e-4,
            betas=(0.9, 0.95),
            eps=1e-8,
            foreach=self.device.type != "cuda",
            fused=self.device.type == "cuda" or None,
        )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 2))
        self.data = np.memmap(CORPUS / "train.bin", dtype=np.uint16, mode="r")
        self.rng = np.random.default_rng(0)
        self.args = args
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if args.precision == "bf16" else torch.autocast(self.device.type, enabled=False)

    def batch(self):
        a = self.args
        starts = self.rng.integers(0, len(self.data) - a.seq_len - 1, a.micro_batch)
        rows = np.stack([self.data[s : s + a.seq_len + 1] for s in starts]).astype(np.int64)
        t = torch.from_numpy(rows).to(self.device)
        return t[:, :-1], t[:, 1:]

    def step(self) -> None:
        for _ in range(self.args.accum):
            x, y = self.batch()
            with self.autocast:
                loss = self.model(x, y)
            (loss / self.args.accum).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def time(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--no-record", action="store_true", help="print only; do not append to bench/results.jsonl")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.overhead: --device cuda asked, but torch sees no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    trainer = plait_trainer(args)
    hand = HandLoop(trainer, args)
    time_plait(trainer, 2)  # warm-up both
    hand.time(2)
    plait_t, hand_t = [], []
    for _ in range(args.repeats):
        plait_t.append(time_plait(trainer, args.steps))
        hand_t.append(hand.time(args.steps))
    p_med, h_med = statistics.median(plait_t), statistics.median(hand_t)
    tokens = args.micro_batch * args.seq_len * args.accum
    rows = [
        ["hand-written loop", h_med * 1000, tokens / h_med, 1.0],
        ["plait", p_med * 1000, tokens / p_med, p_med / h_med],
    ]
    body = table(["loop", "median step ms", "tokens/s", "ratio to hand loop"], rows)
    body += (
        f"\n\nflavor `{args.flavor}`, {args.precision}, micro-batch {args.micro_batch} x seq {args.seq_len} x accum {args.accum}, "
        f"{args.steps} steps x {args.repeats} alternating repeats; per-repeat ms plait {[round(t * 1000, 1) for t in plait_t]}, "
        f"hand {[round(t * 1000, 1) for t in hand_t]}"
    )
    print(body)
    if not args.no_record:
        report(f"Framework overhead: {args.flavor} on {args.device}", body, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
