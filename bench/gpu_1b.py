"""GPU speed of the `1b` flavor at seq 2048 on one GPU: every variant in one run, under 10 minutes.

Variants: bf16 eager, bf16 + torch.compile, activation checkpointing (all
blocks, every 2nd block), a micro-batch sweep, then fp8 (torchao tensorwise
and rowwise; tensorwise also at micro-batch 16 beside bf16 there, and with the output
head converted), and ``config-1b_h100``: the speed settings of
``train_configs/1b_h100.toml`` as they stand in the file (compile, no
activation checkpointing, ``micro_batch = "auto"``, fused AdamW, bf16, SDPA). Each variant trains ``--steps`` timed steps after
``--warmup`` steps through plait's own Trainer (one process, no data files:
``synthetic`` random tokens), and reports tokens/s, MFU and peak memory.
The loss is chunked (``model.loss_chunk_tokens``) so the 131072-wide logits
never exist whole.

    python -m bench.gpu_1b                    # every 1b variant, appends its figures to bench/results.jsonl
    python -m bench.gpu_1b --only bf16-eager  # one variant
    python -m bench.gpu_1b --only 8b-fsdp2-offload-ac-mb1   # the 8b flavor, one GPU, fsdp2 + CPU offload

The 8b variant (not in the default set) shards over a one-rank group with
parameters, gradients and AdamW state in host memory (16 bytes per
parameter, about 120 GiB). It first compares that with the host's available
memory and reports "does not fit" instead of running when it cannot.

Exits with code 2 (and prints no figure) when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.common import report, synthetic_config, table

BASE = ["--precision.name=bf16", "--optimizer.impl=fused"]

VARIANTS: dict[str, list[str]] = {
    "bf16-eager-mb4": ["--train.micro_batch=4"],
    "bf16-compile-mb4": ["--train.micro_batch=4", "--train.compile=true"],
    "bf16-compile-ac-full-mb16": ["--train.micro_batch=16", "--train.compile=true", "--train.activation_checkpointing=full"],
    "bf16-compile-ac-every2-mb8": [
        "--train.micro_batch=8",
        "--train.compile=true",
        "--train.activation_checkpointing=full",
        "--train.activation_checkpointing_every=2",
    ],
    "bf16-compile-mb8": ["--train.micro_batch=8", "--train.compile=true"],
    "bf16-compile-ac-selective-mb16": ["--train.micro_batch=16", "--train.compile=true", "--train.activation_checkpointing=selective"],
    "fp8-tensorwise-compile-mb8": ["--train.micro_batch=8", "--train.compile=true", "--precision.name=fp8", "--precision.recipe=tensorwise"],
    "fp8-rowwise-compile-mb8": ["--train.micro_batch=8", "--train.compile=true", "--precision.name=fp8", "--precision.recipe=rowwise"],
    # fp8 against bf16 at the micro-batch the 1b config's "auto" chose on an H100 (16), and with the
    # output head in fp8 too (about a fifth of the 1b flavor's FLOPs; torchtitan keeps it in bf16)
    "bf16-compile-mb16": ["--train.micro_batch=16", "--train.compile=true"],
    "fp8-tensorwise-compile-mb16": ["--train.micro_batch=16", "--train.compile=true", "--precision.name=fp8", "--precision.recipe=tensorwise"],
    "fp8-tensorwise-head-compile-mb16": [
        "--train.micro_batch=16",
        "--train.compile=true",
        "--precision.name=fp8",
        "--precision.recipe=tensorwise",
        "--precision.skip_head=false",
    ],
}
OPT_IN: dict[str, list[str]] = {
    "8b-fsdp2-offload-ac-mb1": [
        "--train.micro_batch=1",
        "--model.flavor=8b",
        "--parallelism.name=fsdp2",
        "--parallelism.cpu_offload=true",
        "--train.activation_checkpointing=full",
    ],
}
CONFIG = "train_configs/1b_h100.toml"
# The speed settings of the 1b train config that a one-GPU synthetic run can take over
# (the data, the schedule and the batch size stay the bench's).
CONFIG_KEYS = {
    "train": ("compile", "activation_checkpointing", "activation_checkpointing_every", "micro_batch", "micro_batch_max"),
    "model": ("attention", "loss_chunk_tokens"),
    "optimizer": ("impl",),
    "precision": ("name",),
}
HOST_BYTES_PER_PARAM = 16  # fp32 parameter + fp32 gradient + two fp32 AdamW moments, all offloaded


def config_overrides(path: str = CONFIG) -> list[str]:
    """The 1b train config's speed settings as overrides (variant ``config-1b_h100``), read from the file
    so the variant measures what the config trains with."""
    import tomllib

    from bench.common import REPO

    cfg = tomllib.loads((REPO / path).read_text())
    out = []
    for section, keys in CONFIG_KEYS.items():
        for key in keys:
            if key in cfg.get(section, {}):
                value = cfg[section][key]
                text = str(value).lower() if isinstance(value, bool) else str(value)
                out.append(f"--{section}.{key}={text}")
    return out


VARIANTS["config-1b_h100"] = config_overrides()


def micro_batch_of(extra: list[str]) -> int:
    """The micro-batch a variant asks for; with ``auto``, the largest it may pick (``micro_batch_max``,
    64 by default), which sets the bench's global batch so that every smaller candidate divides it."""
    opts = dict(a.removeprefix("--").split("=", 1) for a in extra)
    micro = opts.get("train.micro_batch", "8")
    return int(opts.get("train.micro_batch_max", 64)) if micro == "auto" else int(micro)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else 0 (unknown: the check refuses)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_tflops() -> float | None:
    """The device's dense bf16 peak in TFLOP/s from the mfu monitor (one table for training and benches)."""
    import torch

    from plugins.monitors.mfu import peak_flops

    peak = peak_flops(torch.device("cuda", 0))
    return peak / 1e12 if peak is not None else None


def run_variant(name: str, extra: list[str], steps: int, warmup: int, profile: str = "") -> dict:
    import torch

    from core.contract.protocols import DistInfo
    from core.loop.trainer import Trainer
    from core.preflight.prepare import prepare

    mb = micro_batch_of(extra)
    overrides = BASE + extra + [f"--train.global_batch_tokens={mb * 2048}", f"--train.steps={steps + warmup}"]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        cfg = synthetic_config("1b", 2048, mb, "cuda", "/tmp/plait-bench-gpu", loss_chunk_tokens=8192)
        prep = prepare(str(cfg), overrides, world_size=1)
        if name in OPT_IN:
            with torch.device("meta"):
                params = sum(p.numel() for p in prep.spec.build().parameters())
            need, have = params * HOST_BYTES_PER_PARAM, host_available_bytes()
            if need > 0.9 * have:
                return {"variant": name, "status": f"does not fit: needs {need / 2**30:.0f} GiB host memory, {have / 2**30:.0f} GiB available"}
        trainer = Trainer(prep, DistInfo(device=torch.device("cuda", 0), backend="none"))
        trainer.build()
        trainer.run.total_steps = warmup
        trainer.fit()
        torch.cuda.synchronize()
        trainer.run.total_steps = warmup + steps
        t0 = time.perf_counter()
        trainer.fit()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
        if profile:
            profile_steps(trainer, profile)
    except torch.OutOfMemoryError:
        return {"variant": name, "status": "out of memory"}
    tokens_s = prep.tokens_per_step / dt
    chosen = trainer.rc.train.micro_batch
    flops = prep.spec.flops_per_token(2048) * tokens_s
    peak = peak_tflops()
    result = {
        "variant": name,
        "status": "ok",
        "step_s": dt,
        "tokens_per_s": tokens_s,
        "mfu": flops / (peak * 1e12) if peak else None,
        "peak_tflops": peak,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "micro_batch": chosen,
    }
    del trainer
    return result


def profile_steps(trainer, path: str, steps: int = 2) -> None:
    """Two more steps under torch.profiler: the kernels by total GPU time, written to ``path``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.run.total_steps += steps
        trainer.fit()
        torch.cuda.synchronize()
    table_text = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    with open(path, "w") as f:
        f.write(table_text)
    print(table_text, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", choices=list(VARIANTS) + list(OPT_IN), help="run only these variants")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--profile", default="", help="after timing, profile two steps of each variant and write the kernel table here")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.gpu_1b: no CUDA device; this benchmark measures GPU speed only and prints no figure", file=sys.stderr)
        return 2
    rows, rows_raw = [], []
    for name in args.only or list(VARIANTS):
        try:
            r = run_variant(name, {**VARIANTS, **OPT_IN}[name], args.steps, args.warmup, f"{args.profile}.{name}.txt" if args.profile else "")
        except Exception as e:  # a variant that cannot run here (fp8 on a pre-Hopper GPU...) is reported, not faked
            r = {"variant": name, "status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}
        print(r, flush=True)
        rows_raw.append(r)
        rows.append(
            [
                r["variant"],
                r["status"],
                r.get("micro_batch", "-"),
                r.get("tokens_per_s", "-"),
                f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a",
                r.get("peak_mem_gib", "-"),
            ]
        )
    body = table(["variant", "status", "micro-batch", "tokens/s", "MFU (bf16 dense peak)", "peak GiB"], rows)
    peaks = {r.get("peak_tflops") for r in rows_raw if r.get("peak_tflops")}
    body += (
        "\n\nMFU = tokens/s x FLOPs per token, output layer counted (docs/metrics.md: 8.25 GFLOP/token for 1b at "
        f"seq 2048) / the device's dense bf16 peak ({', '.join(f'{p:g}' for p in peaks) or 'unknown'} TFLOP/s)."
    )
    print(body)
    if not args.no_record:
        report("1b flavor, seq 2048, one GPU", body, device="cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())
