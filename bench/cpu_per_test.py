"""CPU seconds per test: a pytest plugin that records each test's CPU time (this process plus every
child it waited for, e.g. torchrun jobs) to a JSON-lines file, and a report of the totals per file.

CPU seconds, unlike wall time, do not grow when other work shares the machine.

    python -m pytest -p bench.cpu_per_test -p no:randomly -n 0 tests/test_x.py   # writes cpu_per_test.jsonl
    python -m bench.cpu_per_test cpu_per_test.jsonl                                      # totals per file, dearest first

``PLAIT_CPU_PER_TEST`` names the output file (default ``cpu_per_test.jsonl`` in the current folder).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections import defaultdict
from pathlib import Path

import pytest


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # type: ignore[no-untyped-def]
    start = _cpu()
    yield
    row = {"test": item.nodeid, "file": item.nodeid.split("::")[0], "cpu_s": round(_cpu() - start, 3)}
    with open(os.environ.get("PLAIT_CPU_PER_TEST", "cpu_per_test.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def main(argv: list[str]) -> None:
    rows = [json.loads(line) for p in argv for line in Path(p).read_text().splitlines() if line.strip()]
    per_file: dict[str, float] = defaultdict(float)
    for r in rows:
        per_file[r["file"]] += r["cpu_s"]
    for name, cpu in sorted(per_file.items(), key=lambda kv: -kv[1]):
        sys.stdout.write(f"{cpu:9.1f}  {name}\n")
    sys.stdout.write(f"{sum(per_file.values()):9.1f}  total\n\n")
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:40]:
        sys.stdout.write(f"{r['cpu_s']:9.1f}  {r['test']}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
