"""Checkpoint stall: how long training waits for a sync save vs an async save (dcp.async_save).

One process, the model and AdamW state of a flavor (one real training step
first, so the optimizer state exists), saved ``--repeats`` times each way
through plait's Checkpointer. "stall" is the time the training loop is
blocked: for an async save, the call and the copy of the state to host memory,
as if the next optimizer step came at once (the overlap with the next
forward and backward is not credited). "until committed" is until the
COMMITTED marker exists. The first async save also allocates the host
buffers the later ones reuse unless they were allocated before it, as the
trainer has them allocated in the background once the optimizer state
exists; the bench allocates them first (the time it took is printed) and
shows the first save apart.

    python -m bench.checkpoint_stall --flavor 50m --repeats 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import report, synthetic_config, table


def build(flavor: str, out: Path, device: str):
    import torch

    from core.contract.protocols import DistInfo
    from core.loop.trainer import Trainer
    from core.preflight.prepare import prepare

    prep = prepare(str(synthetic_config(flavor, 128, 1, device, str(out))))
    trainer = Trainer(prep, DistInfo(device=torch.device(device)))
    trainer.build()
    trainer.fit()  # one step: the optimizer state exists
    return trainer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="50m")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.checkpoint_stall: --device cuda asked, but torch sees no CUDA device", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="plait-ckpt-bench-"))
    try:
        trainer = build(args.flavor, tmp, args.device)
        ckpt = trainer.checkpointer
        params = sum(p.numel() for p in trainer.model.parameters())
        prepared_s = None
        if "async" in args.modes:  # what the trainer does before each update once the optimizer state exists
            t0 = time.perf_counter()
            ckpt.async_saves.host_stager().prepare(ckpt.contents.dcp_state()).result()
            prepared_s = time.perf_counter() - t0
        results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in args.modes}
        step = 100
        for _ in range(args.repeats):
            for mode in args.modes:
                step += 1
                t0 = time.perf_counter()
                ckpt.save(step, use_async=mode == "async")
                ckpt.wait_for_staging()
                stall = ckpt.last_stall_s
                ckpt.wait()
                results[mode].append((stall, time.perf_counter() - t0))
        size = sum(f.stat().st_size for f in (tmp / "checkpoints" / f"step_{step:09d}").rglob("*") if f.is_file())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for mode, r in results.items():
        later = r[1:] or r
        rows.append([mode, r[0][0], statistics.median(s for s, _ in later), statistics.median(t for _, t in later)])
    body = table(["save", "first save's stall s", "stall s (median of the later saves)", "until committed s (median of the later)"], rows)
    body += (
        f"\n\nflavor `{args.flavor}`: {params:,} parameters, checkpoint {size / 2**20:,.0f} MiB (fp32 weights + AdamW moments), "
        f"{args.repeats} saves each way, one process, local disk."
    )
    if prepared_s is not None:
        body += (
            f" Async saves' host buffers were allocated first, as the trainer has them allocated in the"
            f" background during the steps before the first save: {prepared_s:.2f} s (training goes on meanwhile)."
        )
    print(body)
    if not args.no_record:
        report(f"Checkpoint stall: {args.flavor} on {args.device}", body, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
