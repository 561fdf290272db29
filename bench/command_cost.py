"""CPU seconds and wall time of one plait command: fresh interpreters, and processes forked from a warm one.

The test suite starts some thousands of plait processes (``tests/prestarted.py`` forks most of them
from interpreters that have imported torch already), so what one start costs sets how long the suite
takes on a 2-core machine. Measured here, each in its own process, in turn round by round (medians):

- a fresh ``python -m core.plan`` and a fresh one-step ``python -m core.train`` of the tests' small
  config, in this checkout and, with ``--vs PATH``, in another one (another commit, side by side);
- the same one-step run forked from a warm interpreter as the tests make them (this checkout's
  sources and their bytecode, ``gc.freeze()`` after the imports): one that has imported torch
  (``prestarted.PRELOADED``) and one that has imported plait's modules too (``prestarted.plait_modules``).

    python -m bench.command_cost --rounds 3 [--vs /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, report, table

PACKAGES = ("core", "plugins", "model_specs")

WARM = r"""
import gc, importlib, os, resource, sys, time
sys.path.insert(0, sys.argv.pop(1))
from prestarted import PRELOADED, plait_modules  # what the tests' warm interpreters import
for name in (*PRELOADED, *(plait_modules() if sys.argv[1] == "plait" else ())):
    importlib.import_module(name)
gc.collect()
gc.freeze()
before = resource.getrusage(resource.RUSAGE_CHILDREN)
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    from core.cli.train import main
    try:
        main(sys.argv[2:])
    except SystemExit as e:
        os._exit(e.code or 0)
    os._exit(0)
_, status = os.waitpid(pid, 0)
after = resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
print(os.waitstatus_to_exitcode(status), cpu, time.perf_counter() - t0)
"""


def tiny_config(folder: Path) -> Path:
    """The tests' small config (``tests/conftest.write_tiny_config``), written into ``folder``."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import write_tiny_config

    return write_tiny_config(folder)


def fresh(checkout: Path, module: str, args: list[str]) -> tuple[float, float]:
    """CPU seconds and wall seconds of ``python -m module args`` run in ``checkout`` (its sources first on sys.path)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(checkout)}
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=checkout, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{module} in {checkout} failed ({r.returncode}): {r.stderr[-2000:]}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def forked(sources: Path, preload: str, args: list[str]) -> tuple[float, float]:
    """CPU seconds and wall seconds of the child forked from a warm interpreter that has imported torch
    (``preload`` ``torch``) or torch and plait (``plait``); the warm one's own imports are not counted."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(sources)}
    r = subprocess.run([sys.executable, "-c", WARM, str(REPO / "tests"), preload, *args], cwd=sources, env=env, capture_output=True, text=True)
    code, cpu, wall = r.stdout.split()
    if r.returncode != 0 or code != "0":
        raise SystemExit(f"a forked run failed ({code}): {r.stderr[-2000:]}")
    return float(cpu), float(wall)


def copy_sources(into: Path, bytecode: bool) -> Path:
    into.mkdir()
    for package in PACKAGES:
        shutil.copytree(REPO / package, into / package, ignore=shutil.ignore_patterns("__pycache__"))
    if bytecode:
        import compileall

        for package in PACKAGES:
            compileall.compile_dir(into / package, quiet=2)
    return into


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vs", type=Path, default=None, help="another checkout whose fresh commands run beside this one's")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="plait-bench-cost-") as tmp:
        root = Path(tmp)
        config = tiny_config(root)
        checkouts = {"this checkout": REPO} | ({f"{a.vs}": a.vs.resolve()} if a.vs else {})
        compiled = copy_sources(root / "bytecode", bytecode=True)
        cases: dict[str, object] = {}
        for name, checkout in checkouts.items():
            cases[f"fresh `core.plan`, {name}"] = ("fresh", checkout, "core.plan", [])
            cases[f"fresh `core.train`, 1 step, {name}"] = ("fresh", checkout, "core.train", ["--train.steps=1"])
        for preload, label in (("torch", "torch"), ("plait", "torch and plait")):
            cases[f"forked `core.train`, 1 step, warm interpreter with {label} imported"] = ("forked", compiled, preload, ["--train.steps=1"])
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
        run = 0
        for _ in range(a.rounds):
            for key, (kind, where, what, extra) in cases.items():  # type: ignore[misc]
                run += 1
                args = ["--config", str(config), f"--train.output_dir={root / f'out{run}'}", *extra]
                got[key].append(fresh(where, what, args) if kind == "fresh" else forked(where, what, args))
                print(key, got[key][-1], flush=True)
    rows = [[k, statistics.median(c for c, _ in v), statistics.median(w for _, w in v)] for k, v in got.items()]
    body = table(["command", "CPU s (median)", "wall s (median)"], rows)
    note = f"{a.rounds} rounds, every command once a round in the order listed; OMP_NUM_THREADS=1 as in the tests"
    print(body)
    report("Command cost: fresh and forked plait processes", body, note=note)


if __name__ == "__main__":
    main()
