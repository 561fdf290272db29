"""Where plait's step time goes, against bench.peers' bare loop: op counts and host functions per step.

Both candidates of :mod:`bench.peers` (same shape, batch, precision, optimizer;
one process, or each rank of a torchrun job) run ``--warmup`` steps, then
``--steps`` steps under ``torch.profiler`` (CPU activity): the table lists,
per step, every op whose count differs between plait and the bare loop, with
its count and self CPU time per step in each. plait's ``fit()`` is profiled
for ``--steps`` + 1 steps and for 1 step, and the difference is divided by
``--steps``, so the per-run work of ``fit()`` (start and end hooks, the final
status file, and the last step, which always logs) is not charged to the step. ``--cprofile`` adds plait's Python
functions (cProfile, cumulative time per step) of the trainer and core modules.

Counts are exact; the times are whatever this machine gives under its load
(the report prints the 1-minute load average beside them).

    python -m bench.step_profile --steps 10
    python -m bench.step_profile --steps 10 --cprofile
    torchrun --nproc_per_node=2 -m bench.step_profile --steps 10
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench import peers


def op_table(prof) -> dict[str, tuple[int, float]]:
    """op name -> (calls, self CPU microseconds) from a finished profile."""
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages():
        out[e.key][0] += e.count
        out[e.key][1] += e.self_cpu_time_total
    return {k: (v[0], v[1]) for k, v in out.items()}


def diff(a: dict, b: dict, steps: int) -> dict[str, tuple[float, float]]:
    """(a - b) per step for every op."""
    keys = set(a) | set(b)
    return {k: ((a.get(k, (0, 0))[0] - b.get(k, (0, 0))[0]) / steps, (a.get(k, (0, 0))[1] - b.get(k, (0, 0))[1]) / steps) for k in keys}


def profile_plait(a) -> tuple[dict, dict]:
    trainer = peers.plait_trainer(a, a.warmup)
    trainer.fit()
    peers.barrier()

    def fit_for(steps: int):
        trainer.run.total_steps = trainer.run.step + steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.fit()
        return op_table(prof)

    one = fit_for(1)
    full = fit_for(a.steps + 1)
    stats = {}
    if a.cprofile:
        import cProfile
        import pstats

        runs = []
        for steps in (1, a.steps + 1):
            pr = cProfile.Profile()
            trainer.run.total_steps = trainer.run.step + steps
            pr.enable()
            trainer.fit()
            pr.disable()
            runs.append(pstats.Stats(pr).stats)
        stats = {k: (v[1] - runs[0].get(k, (0, 0, 0, 0))[1], v[3] - runs[0].get(k, (0, 0, 0, 0))[3]) for k, v in runs[1].items()}
    return diff(full, one, a.steps), stats


def profile_bare(a, s) -> dict:
    peers.init_dist()
    torch.manual_seed(0)
    model = peers.ddp_wrap(peers.bare_model(s))
    opt = torch.optim.AdamW(peers.adamw_groups(model), lr=peers.LR, betas=peers.BETAS, eps=peers.EPS)
    data = peers.Windows(a.seq_len, a.micro_batch, s["vocab_size"])

    def step():
        x, y = data.next()
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), peers.CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    peers.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            step()
    return diff(op_table(prof), {}, a.steps)


def python_functions(stats: dict, steps: int, top: int) -> list[tuple[str, float, float]]:
    """(function, calls per step, cumulative ms per step) of plait's own code, by cumulative time;
    ``stats``: (path, line, name) -> (calls, cumulative s), already the difference of two runs."""
    rows = []
    for (path, line, name), (calls, cum) in stats.items():
        if "/core/" in path or "/plugins/" in path or "/model_specs/" in path:
            where = path.split("/wt-speed/")[-1].split("/site-packages/")[-1]
            rows.append((f"{where}:{line} {name}", calls / steps, cum * 1000 / steps))
    return sorted(rows, key=lambda r: -r[2])[:top]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debug", choices=list(peers.SHAPES))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cprofile", action="store_true", help="also list plait's Python functions per step")
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args(argv)
    a.device = "cpu"
    s = dict(peers.SHAPES[a.flavor])
    if a.flavor == "debug":
        s["vocab_size"] = 512
    rank, ws = peers.world()
    plait_ops, stats = profile_plait(a)
    bare_ops = profile_bare(a, s)
    if rank != 0:
        return 0
    print(
        f"# per step, {a.flavor} seq {a.seq_len} micro {a.micro_batch}, {ws} process(es), {a.steps} steps; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (times under that load)"
    )
    for name, ops in (("plait", plait_ops), ("bare", bare_ops)):
        top_level = sum(c for k, (c, _) in ops.items() if k.startswith("aten::"))
        print(f"{name}: {top_level:.0f} aten op calls per step (nested calls included), {sum(t for _, t in ops.values()) / 1000:.1f} ms self CPU per step")
    print(f"\n{'op':60s} {'plait calls':>11s} {'bare calls':>10s} {'plait ms':>9s} {'bare ms':>8s}")
    keys = sorted(set(plait_ops) | set(bare_ops), key=lambda k: -abs(plait_ops.get(k, (0, 0))[1] - bare_ops.get(k, (0, 0))[1]))
    for k in keys:
        pc, pt = plait_ops.get(k, (0, 0.0))
        bc, bt = bare_ops.get(k, (0, 0.0))
        if round(pc, 2) != round(bc, 2):
            print(f"{k[:60]:60s} {pc:11.1f} {bc:10.1f} {pt / 1000:9.2f} {bt / 1000:8.2f}")
    if stats:
        print(f"\nplait's Python functions, per step (cProfile, cumulative; top {a.top}):")
        for name, calls, ms in python_functions(stats, a.steps, a.top):
            print(f"  {ms:8.2f} ms  {calls:6.1f} calls  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
