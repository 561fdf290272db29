"""Recurrent-MoE step time, sparse dispatch against dense, side by side.

Both paths train the same model (same weights, same batch) for ``--steps`` forward + backward + AdamW
steps per round; rounds alternate which path goes first, and the medians over rounds are compared.

    python -m bench.moe_dispatch --experts 8 --top-k 2 --seq-len 256 --micro-batch 4 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench.common import report, table


def step_seconds(model, ids, steps: int, device) -> float:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model(ids, ids).backward()  # warm
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        model(ids, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--flavor", default="debug")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a shared machine)")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)

    from model_specs.recurrent_moe.spec import RecurrentMoEOptions, RecurrentMoESpec

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    models = {}
    for mode in ("dense", "sparse"):
        spec = RecurrentMoESpec.from_options(RecurrentMoEOptions(flavor=args.flavor, n_experts=args.experts, top_k=args.top_k, dispatch=mode))
        torch.manual_seed(0)
        with torch.device(device):
            model = spec.build()
        spec.init_weights(model)
        models[mode] = model.to(dtype)
    models["sparse"].load_state_dict(models["dense"].state_dict())
    vocab = models["dense"].args.base.vocab_size
    ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    times: dict[str, list[float]] = {"dense": [], "sparse": []}
    for r in range(args.rounds):
        for mode in ("dense", "sparse") if r % 2 == 0 else ("sparse", "dense"):
            times[mode].append(step_seconds(models[mode], ids, args.steps, device))
    dense, sparse = statistics.median(times["dense"]), statistics.median(times["sparse"])
    rows = [
        ["dense (every expert on every token)", f"{dense * 1e3:.1f}", ", ".join(f"{t * 1e3:.0f}" for t in times["dense"])],
        ["sparse (routed tokens only)", f"{sparse * 1e3:.1f}", ", ".join(f"{t * 1e3:.0f}" for t in times["sparse"])],
    ]
    body = table(["dispatch", "median step ms", "rounds (ms)"], rows)
    body += (
        f"\n\nsparse / dense step time: {sparse / dense:.2f}. recurrent_moe {args.flavor}, {args.experts} experts, top-{args.top_k}, "
        f"micro-batch {args.micro_batch} x seq {args.seq_len}, {args.dtype}, forward + backward + AdamW, "
        f"{args.steps} steps per round, {args.rounds} alternating rounds, eager, {torch.get_num_threads()} thread(s), "
        f"load average {os.getloadavg()[0]:.1f} at the end."
    )
    print(body)
    if not args.no_record:
        report(f"Recurrent MoE dispatch: sparse vs dense on {device.type}", body, device=device.type)
    return 0


if __name__ == "__main__":
    sys.exit(main())
