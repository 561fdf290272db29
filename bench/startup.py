"""Startup: seconds from process start to the first training step, by phase, and its growth with installed plugins.

Each measurement is a fresh process (``--child``) that times its phases:
imports, plugin discovery, config resolution, model and optimizer build.
Extra plugins are generated distributions on PYTHONPATH, each registering
one monitor.

    python -m bench.startup --plugins 0 10 50 100 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, report, table

CONFIG = REPO / "train_configs" / "debug_cpu.toml"


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc), so interpreter start-up counts too."""
    ticks = os.sysconf("SC_CLK_TCK")
    start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start_ticks / ticks


def child() -> None:
    t = {"python_start": process_age_s()}
    t0 = time.perf_counter()
    import torch  # noqa: F401

    from core.config import registry
    from core.contract.protocols import DistInfo
    from core.loop.trainer import Trainer
    from core.preflight.prepare import prepare

    t1 = time.perf_counter()
    registry.load()
    t2 = time.perf_counter()
    prep = prepare(str(CONFIG), ["--monitors.enabled=[]", "--checkpoint.resume=none", "--train.output_dir=/tmp/plait-bench-startup"])
    t3 = time.perf_counter()
    trainer = Trainer(prep, DistInfo())
    trainer.build()
    t4 = time.perf_counter()
    t.update(imports=t1 - t0, discovery=t2 - t1, config=t3 - t2, build=t4 - t3, total=process_age_s())
    t["interpreter"] = t["total"] - (t4 - t0)
    print(json.dumps(t))


def make_plugins(site: Path, n: int) -> None:
    for i in range(n):
        mod = site / f"bench_plugin_{i}"
        mod.mkdir(parents=True, exist_ok=True)
        (mod / "__init__.py").write_text(
            "from dataclasses import dataclass\n"
            "from core.contract.hookspecs import hookimpl\n"
            "from core.contract.options import option\n"
            "@dataclass\nclass Opts:\n    level: int = option(0, 'a level')\n"
            "class Mon:\n    def __init__(self, options):\n        self.options = options\n"
            "@hookimpl\ndef plait_register(registry):\n"
            f"    registry.add('monitor', 'bench_{i}', Mon, options=Opts, doc='generated')\n"
        )
        dist = site / f"bench_plugin_{i}-0.1.dist-info"
        dist.mkdir(exist_ok=True)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: bench-plugin-{i}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[plait]\nbench_{i} = bench_plugin_{i}\n")


def measure(n: int, repeats: int) -> dict[str, float]:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp)
        make_plugins(site, n)
        env = dict(os.environ, PYTHONPATH=str(site) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
        for _ in range(repeats):
            out = subprocess.run([sys.executable, "-m", "bench.startup", "--child"], cwd=REPO, env=env, capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plugins", type=int, nargs="+", default=[0, 10, 50, 100])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if args.child:
        child()
        return 0
    rows = []
    for n in args.plugins:
        m = measure(n, args.repeats)
        rows.append([n, m["interpreter"], m["imports"], m["discovery"], m["config"], m["build"], m["total"]])
    body = table(
        ["extra plugins", "interpreter s", "imports (torch, plait) s", "discovery s", "config + checks s", "build s", "process start to first step s"], rows
    )
    body += (
        f"\n\nmedian of {args.repeats} fresh processes each; config `train_configs/debug_cpu.toml`, monitors off. "
        "`config + checks` includes the first meta-device model build (torch loads its meta kernels lazily, "
        "about 2 s once per process) used to check a resume checkpoint's shapes before any process group exists."
    )
    print(body)
    if not args.no_record:
        report("Startup to first step", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
