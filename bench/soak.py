"""Soak: what grows over a long run. Host memory, Python objects, file descriptors, threads,
loader worker processes, files on disk and time per step, measured at intervals of long runs of
a tiny model on CPU, with frequent saves (sync and async), validation and every offline monitor.

    python -m bench.soak --steps 3000 --sample-every 100
    python -m bench.soak --steps 600 --scenarios sync,ddp2 --tracemalloc --no-append

Each scenario is a real ``core.train`` run (under ``torchrun`` for two processes) whose ranks run
through this file's ``--worker`` mode: the trainer's own ``in step N`` progress mark takes a
sample every ``--sample-every`` executed steps (the mark that a step's compute begins: rolled-back steps count again), on the main
thread: RSS, threads, open fds, child processes and their RSS, gc-tracked objects (and with
``--tracemalloc`` the traced bytes, with the lines that grew most after the warm-up). The first
``--warmup`` fraction of the run is warm-up (allocator pools, lazy imports, the first saves); the
slopes are fitted to the samples after it. Files are counted in the run folder at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script under torchrun
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, report, table  # noqa: E402

CORPUS = REPO / "plugins" / "data" / "corpus" / "shakespeare"
MONITORS = ["console", "jsonl", "tensorboard", "mfu", "memory", "update_ratio", "budget_guard", "spikes"]


# -- scenarios -----------------------------------------------------------------------------------
def base_config(out: Path, steps: int, nproc: int) -> dict:
    return {
        "extends": str(REPO / "train_configs" / "base.toml"),
        "train": {
            "steps": steps,
            "global_batch_tokens": 256 * nproc,
            "micro_batch": 4,
            "output_dir": str(out),
            "device": "cpu",
            "log_every": 5,
            "seed": 7,
        },
        "model": {"name": "llama3", "flavor": "debug", "dim": 64, "n_layers": 2},
        "data": {"name": "token_bin", "path": str(CORPUS), "seq_len": 64},
        "precision": {"name": "fp32"},
        "optimizer": {"lr": 1e-3},
        "lr_schedule": {"warmup_steps": 10},
        "checkpoint": {"every": 25, "keep_latest": 2, "keep_best": 2},
        "validation": {"every": 50, "batches": 2},
        "monitors": {
            "enabled": MONITORS,
            "budget_guard": {"rate_usd_per_hr": 1.0, "cap_usd": 1e6, "warn_usd": 1e5, "check_every_s": 1.0},
            "spikes": {"action": "log"},
        },
    }


def text_corpus(folder: Path) -> Path:
    """A jsonl of short documents cut from the shipped corpus (a few hundred: the stream wraps often)."""
    import numpy as np

    data = np.fromfile(CORPUS / "train.bin", dtype=np.uint16)[:120_000]
    text = bytes(int(t) for t in data if t < 256).decode("utf-8", "replace")
    path = folder / "docs.jsonl"
    with path.open("w") as f:
        for i in range(0, len(text), 400):
            f.write(json.dumps({"text": text[i : i + 400]}) + "\n")
    return path


# name: what it adds to the base config (a tiny llama3 on token_bin, sync saves every 25 steps, validation every 50)
SCENARIOS = {
    "sync": "one process",
    "async": "async saves",
    "keep_all": "keep_latest = 0, a save every 10 steps, no validation",
    "skip": "spikes with sigmas 2 and min_ratio 1.1, action skip: about one update in four is skipped",
    "rollback": "from step 200, each step number once gets a rare-token batch (spike_rehearsal), rolled back by spikes; saves every 5",
    "text_stream": "text_stream, 2 loader workers, shuffle buffer, wrapping every few hundred steps",
    "mixture": "mixture of token_bin and text_stream (no workers)",
    "ddp2": "2 processes (torchrun, gloo), async saves",
    "ddp2_text_stream": "2 processes, text_stream with 2 workers each",
    "ddp2_rollback": "2 processes, async saves, text_stream with 2 workers each, rollbacks as in rollback (300 rehearsed steps)",
}


def scenario(name: str, folder: Path, steps: int) -> tuple[int, dict]:
    """(processes, config) of scenario ``name`` (:data:`SCENARIOS`)."""
    nproc = 2 if name.startswith("ddp2") else 1
    cfg = base_config(folder / "out", steps, nproc)
    if name in ("async", "ddp2", "ddp2_rollback"):
        cfg["checkpoint"]["async"] = True
    if name == "keep_all":
        cfg["checkpoint"].update(every=10, keep_latest=0, keep_best=0)
        cfg["validation"]["every"] = 0
    if name in ("rollback", "ddp2_rollback"):
        cfg["monitors"]["enabled"] = MONITORS + ["spike_rehearsal"]
        cfg["monitors"]["spikes"] = {"action": "rollback"}
        cfg["monitors"]["spike_rehearsal"] = {"at_step": 200, "steps": 1000 if name == "rollback" else 300}
        cfg["checkpoint"]["every"] = 5
    if name == "skip":
        cfg["monitors"]["spikes"] = {"action": "skip", "sigmas": 2.0, "min_ratio": 1.1, "max_in_a_row": 0}
    if name in ("text_stream", "ddp2_text_stream", "ddp2_rollback", "mixture"):
        stream = {"files": [str(text_corpus(folder))], "shuffle_buffer": 16, "workers": 0 if name == "mixture" else 2}
        if name == "mixture":
            bins = {"name": "token_bin", "weight": 0.5, "path": str(CORPUS)}
            cfg["data"] = {"name": "mixture", "seq_len": 64, "sources": [bins, {"name": "text_stream", "weight": 0.5, **stream}]}
        else:
            cfg["data"] = {"name": "text_stream", "seq_len": 64, **stream}
        cfg["validation"]["every"] = 0  # a stream has no validation split
        cfg["checkpoint"]["keep_best"] = 0
    return nproc, cfg


# -- the worker: one rank of a run, sampled --------------------------------------------------------
def proc_status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "Threads"):
            out[key] = int(value.split()[0])
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: loader workers, their fork server and its resource tracker."""
    kids = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        return []
    return kids + [d for k in kids for d in descendants(k)]


def machine_speed() -> float:
    """CPU seconds of a fixed piece of work (small matmuls and a Python loop), the least of three: the
    machine's speed now, which other processes on a shared machine change; step costs are divided by it."""
    import torch

    best = float("inf")
    for _ in range(3):
        a = torch.full((64, 64), 0.01)
        t0 = time.thread_time()
        for _ in range(400):
            a = (a @ a).clamp_(max=1.0)
            sum(range(500))
        best = min(best, time.thread_time() - t0)
    return best


class Sampler:
    def __init__(self, path: Path, every: int, warmup_steps: int, traced: bool) -> None:
        self.file, self.every, self.warmup_steps, self.traced = path.open("w"), every, warmup_steps, traced
        self.executed = 0
        self.t0 = time.perf_counter()
        self.first_snapshot = None

    def sample(self, step: int) -> None:
        import tracemalloc

        gc.collect()
        status = proc_status()
        kids = descendants(os.getpid())
        kid_rss = 0
        for k in kids:
            try:
                kid_rss += proc_status(k).get("VmRSS", 0)
            except OSError:
                pass
        row = {
            "executed": self.executed,
            "step": step,
            "t": time.perf_counter() - self.t0,
            "cpu": time.process_time(),  # every thread of this process: less noisy than wall time on a shared machine
            "rss_kb": status["VmRSS"],
            "threads": status["Threads"],
            "py_threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")),
            "children": len(kids),
            "children_rss_kb": kid_rss,
            "gc_objects": len(gc.get_objects()),
            "calib": machine_speed(),
        }
        if self.traced:
            row["traced_kb"] = tracemalloc.get_traced_memory()[0] // 1024
            if self.first_snapshot is None and self.executed >= self.warmup_steps:
                self.first_snapshot = tracemalloc.take_snapshot()
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def before_step(self, step: int) -> None:
        if self.executed % self.every == 0 and self.executed:
            self.sample(step)
        self.executed += 1

    def finish(self, top_file: Path) -> None:
        import tracemalloc

        if not self.traced or self.first_snapshot is None:
            return
        diff = tracemalloc.take_snapshot().compare_to(self.first_snapshot, "lineno")
        top_file.write_text("\n".join(str(d) for d in diff[:25]) + "\n")


def worker(args: argparse.Namespace, train_argv: list[str]) -> None:
    import tracemalloc

    from core.cli import train
    from core.runtime import watchdog

    if args.tracemalloc:
        tracemalloc.start(1)
    rank = int(os.environ.get("RANK", "0"))
    sampler = Sampler(Path(args.samples_prefix + f"{rank}.jsonl"), args.sample_every, args.warmup_steps, args.tracemalloc)
    progress = watchdog.progress

    def marked(doing: str, step: int | None = None, waits: bool = False) -> None:
        progress(doing, step, waits)
        if step is not None and doing.startswith("in step "):  # each step attempted, a rolled-back one again
            sampler.before_step(step)

    watchdog.progress = marked  # type: ignore[assignment]  # the loop calls watchdog.progress(...) through the module
    try:
        code = train.main(train_argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    sampler.finish(Path(args.samples_prefix + f"{rank}.top.txt"))
    from core.data.indexed import _shut_down_workers

    _shut_down_workers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


# -- the orchestrator --------------------------------------------------------------------------------
def slope_per_1k(rows: list[dict], key: str) -> float:
    """Least-squares slope of ``key`` per 1,000 executed steps."""
    xs, ys = [r["executed"] for r in rows], [r[key] for r in rows]
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def step_times(rows: list[dict], clock: str = "t", per_speed: bool = False) -> tuple[float, float]:
    """Seconds per executed step (wall ``t`` or ``cpu``) over the first and the last quarter of the steady
    samples (medians); ``per_speed``: in units of :func:`machine_speed` measured at the interval's end."""
    per = [(b[clock] - a[clock]) / (b["executed"] - a["executed"]) / (b["calib"] if per_speed else 1.0) for a, b in zip(rows, rows[1:])]
    q = max(1, len(per) // 4)
    return statistics.median(per[:q]), statistics.median(per[-q:])


def disk(out: Path) -> dict[str, float]:
    files = [p for p in out.rglob("*") if p.is_file()]
    ckpt = out / "checkpoints"
    return {
        "files": len(files),
        "mib": sum(p.stat().st_size for p in files) / 2**20,
        "checkpoints": len([p for p in ckpt.glob("step_*") if p.is_dir()]) if ckpt.is_dir() else 0,
        "abandoned": len(list((ckpt / "abandoned").iterdir())) if (ckpt / "abandoned").is_dir() else 0,
        "tb_files": len(list((out / "tensorboard").glob("*"))) if (out / "tensorboard").is_dir() else 0,
        "metrics_kib": (out / "metrics.jsonl").stat().st_size / 1024 if (out / "metrics.jsonl").is_file() else 0.0,
        "hidden": len([p for p in files if p.name.startswith(".plait")]),
    }


def run_scenario(name: str, root: Path, args: argparse.Namespace) -> list[list]:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    nproc, cfg = scenario(name, folder, args.steps)
    from core.config.files import dumps

    config = folder / "run.toml"
    config.write_text(dumps(cfg))
    prefix = str(folder / "samples_rank")
    warmup = int(args.steps * args.warmup)
    mode = ["--worker", "--sample-every", str(args.sample_every), "--warmup-steps", str(warmup), "--samples-prefix", prefix]
    mode += ["--tracemalloc"] if args.tracemalloc else []
    script = str(Path(__file__).resolve())
    if nproc == 1:
        cmd = [sys.executable, script, *mode, "--", "--config", str(config)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *mode, "--", "--config", str(config)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    hung = ""
    with (folder / "stdout.log").open("w") as out, (folder / "stderr.log").open("w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
        samples, last_change = Path(f"{prefix}0.jsonl"), time.monotonic()
        size = -1
        while proc.poll() is None:  # a run whose samples stop coming for --hang-s is hung: ended, and said so
            time.sleep(2)
            now_size = samples.stat().st_size if samples.exists() else 0
            if now_size != size:
                size, last_change = now_size, time.monotonic()
            elif time.monotonic() - last_change > args.hang_s:
                hung = f" (hung: no sample for {args.hang_s:.0f} s, ended)"
                os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    wall = time.perf_counter() - t0
    files = disk(folder / "out")
    logs_kib = sum((folder / f).stat().st_size for f in ("stdout.log", "stderr.log")) / 1024
    said = (folder / "stdout.log").read_text(errors="replace")
    events = f"{said.count('update skipped')} / {said.count('rolled back to')}"
    print(f"{name}: exit {code}{hung}, {wall:.0f} s, {files}, logs {logs_kib:.0f} KiB", flush=True)
    rows = []
    for rank in range(nproc):
        samples = [json.loads(line) for line in Path(f"{prefix}{rank}.jsonl").read_text().splitlines()]
        # with --tracemalloc, the snapshot taken at the warm-up's end holds memory of its own: the steady samples start after it
        steady = [s for s in samples if s["executed"] > warmup or (s["executed"] == warmup and not args.tracemalloc)]
        if len(steady) < 3:
            print(f"{name} rank {rank}: only {len(steady)} samples after the warm-up", flush=True)
            continue
        a, b = steady[0], steady[-1]
        first, last = step_times(steady)
        cpu_first, cpu_last = step_times(steady, "cpu")
        norm_first, norm_last = step_times(steady, "cpu", per_speed=True)
        top = Path(f"{prefix}{rank}.top.txt")
        if top.is_file():
            print(f"{name} rank {rank}: tracemalloc, the lines that grew most after the warm-up:\n{top.read_text()}", flush=True)
        rows.append(
            [
                f"{name}" + (f" r{rank}" if nproc > 1 else ""),
                f"{a['executed']}-{b['executed']} ({b['step']})",
                events if rank == 0 else "",
                f"{a['rss_kb'] / 1024:.1f} / {b['rss_kb'] / 1024:.1f}",
                f"{slope_per_1k(steady, 'rss_kb') / 1024:+.2f}",
                f"{a['gc_objects']:,} / {b['gc_objects']:,} ({slope_per_1k(steady, 'gc_objects'):+.0f})",
                f"{a['fds']} / {b['fds']}",
                f"{a['threads']} / {b['threads']}",
                f"{a['children']} / {b['children']}"
                + (f" ({a['children_rss_kb'] / 1024:.0f} / {b['children_rss_kb'] / 1024:.0f} MiB)" if b["children"] else ""),
                f"{first * 1000:.1f} / {last * 1000:.1f} ({(last / first - 1) * 100:+.0f}%)",
                f"{cpu_first * 1000:.1f} / {cpu_last * 1000:.1f} ({(cpu_last / cpu_first - 1) * 100:+.0f}%)",
                f"{(norm_last / norm_first - 1) * 100:+.0f}%",
                f"{files['files']} files, {files['checkpoints']} ckpt, {files['abandoned']} aside, {files['tb_files']} tb, "
                f"metrics {files['metrics_kib']:.0f} KiB, logs {logs_kib:.0f} KiB"
                if rank == 0
                else "",
            ]
            + ([f"{(b['traced_kb'] - a['traced_kb']) / 1024:+.2f}"] if args.tracemalloc else [])
        )
        if code != 0:
            rows[-1][0] += f" (exit {code}{hung})"
    return rows


HEADERS = [
    "scenario",
    "steps sampled (last step)",
    "skips / rollbacks",
    "RSS MiB start / end",
    "RSS MiB per 1k steps",
    "gc objects start / end (per 1k)",
    "fds",
    "threads",
    "child processes",
    "wall ms/step first / last quarter",
    "CPU ms/step first / last quarter",
    "CPU per step, drift at the machine's speed",
    "run folder at the end",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of the steps counted as warm-up")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--hang-s", type=float, default=600, help="end a run whose rank 0 took no sample for this long, and say it hung")
    parser.add_argument("--tracemalloc", action="store_true", help="trace Python allocations (slower) and print the lines that grew")
    parser.add_argument("--keep", default="", help="run in this folder and keep it (default: a temporary folder, removed)")
    parser.add_argument("--no-append", action="store_true", help="print the table, do not append its figures to bench/results.jsonl")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warmup-steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--samples-prefix", default="", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    train_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.worker:
        worker(args, train_argv)
        return
    names = [n for n in args.scenarios.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}; scenarios: {', '.join(SCENARIOS)}")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="plait-soak-"))
    rows = []
    try:
        for name in names:
            rows += run_scenario(name, root, args)
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    headers = HEADERS + (["traced MiB growth"] if args.tracemalloc else [])
    body = table(headers, rows) + "\n\n" + "\n".join(f"- `{n}`: {SCENARIOS[n]}" for n in names)
    print(body)
    if not args.no_append:
        note = (
            f"llama3 debug dim 64, 2 layers, seq 64, 256 tokens per step per rank; sync saves every 25 steps keeping 2 latest and 2 best, "
            f"validation every 50 (2 batches), log every 5, monitors {', '.join(MONITORS)} (budget checks every second, spikes logging); "
            f"a sample every {args.sample_every} executed steps after a warm-up of {args.warmup:.0%}, on each rank's main thread after a "
            "gc.collect(); RSS of each rank's process (its loader workers apart); the last sample is the last step's start"
        )
        report(f"Soak: {args.steps} steps on cpu", body, note=note)


if __name__ == "__main__":
    main()
