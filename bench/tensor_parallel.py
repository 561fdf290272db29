"""Step time and peak memory per rank of the parallel layouts on CPU (gloo), one global batch each,
beside fsdp2 alone on 4 ranks: ``--layouts tp`` adds dp 2 x tp 2 on 4 ranks and tp 2 on 2 ranks,
``pp`` pp 2 x dp 2 under 1F1B and GPipe (4 ranks), ``ep`` ep 2 and ep 4 on 4 ranks (``recurrent_moe``);
``tp,pp`` both sets beside one fsdp2 baseline.

Each layout is a ``torchrun`` of ``core.train`` on synthetic tokens, in alternating rounds, at the
``--shape``: ``debug`` (the model's debug flavor) or ``50m`` (:data:`SHAPES`: llama3's ``50m`` flavor
with its vocabulary padded to 50,304, a multiple of the tp degree, and the head untied, as pipeline
stages need; recurrent_moe's ``small`` flavor with 512-wide experts, 42.5M non-embedding parameters).
A run's step time is the median ``step_time_s`` of its steps after the first two, and its memory
the peak resident set of its largest rank (``ru_maxrss`` of the torchrun subtree, read by
``os.wait4``: torch's own libraries included), the largest rank's parameter, gradient and optimizer
state bytes of the last step (the ``memory`` monitor, local shards) and, beside them, ``core.plan``'s
per-rank estimate of the same config and layout.

    nice -n 10 python -m bench.tensor_parallel --rounds 3 --steps 8
    nice -n 10 python -m bench.tensor_parallel --layouts pp --rounds 3 --steps 8
    nice -n 10 python -m bench.tensor_parallel --layouts ep --model recurrent_moe --rounds 3 --steps 8
    nice -n 10 python -m bench.tensor_parallel --shape 50m --layouts tp,pp --seq-len 128 --micro-batch 1 --rounds 2 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import REPO, free_port, report, table

SHAPES: dict[str, dict[str, str]] = {  # shape -> model -> [model] lines of the config
    "debug": {"llama3": 'flavor = "debug"', "recurrent_moe": 'flavor = "debug"'},
    "50m": {
        "llama3": 'flavor = "50m"\nvocab_size = 50304\ntie_embeddings = "false"',
        "recurrent_moe": 'flavor = "small"\nffn_dim = 512\nvocab_size = 50304',
    },
}
FSDP4: dict[str, tuple[int, tuple[str, ...]]] = {"fsdp2 x4": (4, ())}
LAYOUTS: dict[str, dict[str, tuple[int, tuple[str, ...]]]] = {  # set -> layout -> (ranks, options)
    "tp": {**FSDP4, "fsdp2 dp2 x tp2": (4, ("--parallelism.tp=2",)), "tp2 (2 ranks)": (2, ("--parallelism.tp=2",))},
    "pp": {
        **FSDP4,
        "pp2 x dp2, 1F1B": (4, ("--parallelism.pp=2", "--parallelism.pipeline_schedule=1F1B")),
        "pp2 x dp2, GPipe": (4, ("--parallelism.pp=2", "--parallelism.pipeline_schedule=GPipe")),
    },
    "ep": {**FSDP4, "ep2 (4 ranks)": (4, ("--parallelism.ep=2",)), "ep4 (4 ranks)": (4, ("--parallelism.ep=4",))},
}


def write_config(folder: Path, model: str, shape: str, seq_len: int, micro: int, steps: int) -> Path:
    cfg = folder / "bench.toml"
    cfg.write_text(f"""
extends = "{REPO / "train_configs" / "base.toml"}"
[train]
steps = {steps}
global_batch_tokens = {4 * micro * seq_len}
micro_batch = {micro}
device = "cpu"
log_every = 1
[model]
name = "{model}"
{SHAPES[shape][model]}
[data]
name = "synthetic"
kind = "random"
seq_len = {seq_len}
[parallelism]
name = "fsdp2"
[monitors]
enabled = ["jsonl", "memory"]
[checkpoint]
at_end = false
resume = "none"
keep_latest = 0
""")
    return cfg


STATE = ("mem_params_gib", "mem_grads_gib", "mem_optimizer_gib")
PLAN = ("weights_gib", "grads_gib", "optimizer_gib", "activations_gib", "total_gib")


def run(cfg: Path, out: Path, nproc: int, extra: tuple[str, ...]) -> tuple[float, float, list[float]]:
    """(median step seconds after the first two, peak RSS MiB of the largest rank, the largest rank's
    parameter, gradient and optimizer MiB of the last step) of one torchrun."""
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}", "-m", "core.train"]
    out.mkdir(parents=True)
    with open(out / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            [*argv, "--config", str(cfg), f"--train.output_dir={out}", *extra],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        _, status, usage = os.wait4(proc.pid, 0)  # torchrun's usage, its ranks (reaped by it) included
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError((out / "stderr.txt").read_text()[-3000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    times = [r["step_time_s"] for r in train][2:]
    state = [train[-1][k] * 1024 for k in STATE]
    return statistics.median(times), usage.ru_maxrss / 1024, state  # ru_maxrss in KiB: the largest process of the subtree


def mib(value: float) -> str:
    """A MiB figure: whole MiB from 10 up, two significant digits below (the debug shape's state)."""
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def plan(cfg: Path, nproc: int, extra: tuple[str, ...]) -> dict[str, float]:
    """``core.plan``'s memory per rank (GiB) of the config under this layout."""
    argv = [sys.executable, "-m", "core.plan", "--config", str(cfg), "--config-only", "--json", f"--nproc={nproc}", *extra]
    got = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(got.stdout)["memory_per_rank"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3", choices=["llama3", "recurrent_moe"])
    p.add_argument("--shape", default="debug", choices=sorted(SHAPES))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--layouts", default="tp", help=f"which layouts beside fsdp2 alone: one of {', '.join(LAYOUTS)} or several, comma-separated")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-record", action="store_true")
    a = p.parse_args(argv)
    sets = a.layouts.split(",")
    if unknown := [s for s in sets if s not in LAYOUTS]:
        p.error(f"--layouts {a.layouts}: unknown {', '.join(unknown)}; expected {', '.join(LAYOUTS)}, comma-separated")
    if "ep" in sets and a.model != "recurrent_moe":
        p.error("--layouts ep needs --model recurrent_moe (llama3 has no experts)")
    folder = Path(tempfile.mkdtemp(prefix="plait-bench-tp-"))
    cfg = write_config(folder, a.model, a.shape, a.seq_len, a.micro_batch, a.steps)
    layouts = {name: layout for s in sets for name, layout in LAYOUTS[s].items()}
    planned = {name: plan(cfg, nproc, extra) for name, (nproc, extra) in layouts.items()}
    got: dict[str, list[tuple[float, float, list[float]]]] = {name: [] for name in layouts}
    load = os.getloadavg()
    for r in range(a.rounds):
        for name, (nproc, extra) in layouts.items():
            got[name].append(run(cfg, folder / f"{r}-{name.replace(' ', '_')}", nproc, extra))
            print(f"round {r + 1} {name}: {got[name][-1][0] * 1e3:.1f} ms/step", flush=True)
    rows = []
    for name, (nproc, _) in layouts.items():
        step = statistics.median(t for t, _, _ in got[name]) * 1e3
        mem = max(m for _, m, _ in got[name])
        state = got[name][-1][2]
        rows.append([name, nproc, step, mem, "/".join(mib(v) for v in state), "/".join(mib(planned[name][k] * 1024) for k in PLAN)])
    tokens = 4 * a.micro_batch * a.seq_len
    body = table(
        [
            "layout",
            "ranks",
            "step ms (median)",
            "peak RSS MiB, largest rank",
            "params/grads/optimizer MiB, largest rank",
            "core.plan MiB per rank: weights/grads/optimizer/activations/total",
        ],
        rows,
    ) + (
        f"\n\n`{a.model}` `{a.shape}` ({SHAPES[a.shape][a.model].replace(chr(10), ', ')}), fp32, {tokens} tokens per step (micro-batch {a.micro_batch} x seq {a.seq_len} "
        f"x 4 ranks' worth: accumulation 4 / data-parallel ranks), {a.steps} steps per run (the first two left out), {a.rounds} alternating rounds, "
        f"gloo on CPU, one thread per rank, {os.cpu_count()} cores, load average (1 min) {load[0]:.1f} at the start and {os.getloadavg()[0]:.1f} at the end: "
        "the ratios, not the times, are the figure. Peak RSS is the largest rank's process, torch included; params/grads/optimizer "
        "the largest rank's local tensors at the last step (`memory` monitor)."
    )
    print(body)
    if not a.no_record:
        title = " and ".join({"tp": "tensor-parallel", "pp": "pipeline-parallel", "ep": "expert-parallel"}[s] for s in sets)
        report(f"{title} layouts, `{a.model}` `{a.shape}`, CPU", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
