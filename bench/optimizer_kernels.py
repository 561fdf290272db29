"""AdamW's kernels on one device: fused, foreach and for-loop over a model flavor's parameters.

The ``adamw`` plugin's ``impl = "auto"`` picks the fused kernel wherever torch
has one. This measures what that choice is worth: the parameters of the
llama3 ``--flavor`` (shapes from a meta-device build, fp32, random values and
gradients), ``torch.optim.AdamW`` with plait's defaults (betas 0.9/0.95,
weight decay 0.1) and each kernel, ``--steps`` steps timed after one warm-up
step, ``--rounds`` alternating rounds; the median and range per kernel.

    python -m bench.optimizer_kernels --flavor 50m
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.common import report, table

KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def shapes(flavor: str) -> list[tuple[int, ...]]:
    import torch

    from model_specs.llama3.spec import Llama3Spec

    with torch.device("meta"):
        model = Llama3Spec.from_flavor(flavor).build()
    return [tuple(p.shape) for p in model.parameters()]  # a tied weight once


def time_kernel(kernel: str, sizes: list[tuple[int, ...]], device: str, steps: int) -> float:
    """Milliseconds per ``optimizer.step()`` with ``kernel``."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, device=device) * 0.02) for s in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device=device) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **KERNELS[kernel])
    opt.step()  # the state exists from here on

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    sync()
    return (time.perf_counter() - start) / steps * 1000


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="50m")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.optimizer_kernels: --device cuda asked, but torch sees no CUDA device", file=sys.stderr)
        return 2
    sizes = shapes(args.flavor)
    n = sum(torch.Size(s).numel() for s in sizes)
    times: dict[str, list[float]] = {k: [] for k in KERNELS}
    for _ in range(args.rounds):
        for kernel in KERNELS:
            times[kernel].append(time_kernel(kernel, sizes, args.device, args.steps))
    fused = statistics.median(times["fused"])
    rows = [[k, round(statistics.median(v), 1), f"{min(v):.1f}-{max(v):.1f}", round(statistics.median(v) / fused, 2)] for k, v in times.items()]
    body = table(["kernel", "median ms per step", "range (ms)", "x fused"], rows)
    body += (
        f"\n\ntorch.optim.AdamW over the llama3 `{args.flavor}` parameters ({n:,} in {len(sizes)} tensors, fp32), "
        f"{args.steps} timed steps after one warm-up step per measurement, {args.rounds} alternating rounds."
    )
    print(body)
    if not args.no_record:
        report(f"AdamW kernels: {args.flavor} parameters on {args.device}", body, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
