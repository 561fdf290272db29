"""A command (the test suite, by default) while busy loops compete with it for every core.

Starts ``--busy`` processes that each spin without pause (``sh -c 'while :; do :; done'``), runs the
command beside them, and reports its exit code, its wall time, the one-minute load average as it
ended and its last summary line (pytest's counts); its whole output is kept in ``--log``. The busy loops end with the command, on an
exception or on SIGTERM. It shows whether a test depends on the machine being idle: none may.

    python -m bench.suite_under_load [--busy 2] [--log FILE] [--no-write] [-- python -m pytest -q -n 3 --dist worksteal]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.common import REPO, report, table
from bench.suite_processes import DEFAULT_COMMAND as README_PYTEST

DEFAULT_COMMAND = [*README_PYTEST, "-p", "no:cacheprovider"]
SUMMARY = re.compile(r"^=*\s*(\d+ [a-z]+(?:, \d+ [a-z]+)*) in [\d.]+s")


def summary_line(output: str) -> str:
    """pytest's closing counts (``1045 passed, 7 skipped, 87 warnings``) from its output, or ``""``."""
    for line in reversed(output.splitlines()):
        found = SUMMARY.match(line.strip())
        if found:
            return found.group(1)
    return ""


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[list[subprocess.Popen]]:
    """``n`` processes that each spin on a core, each in a process group of its own, killed on leaving
    (an exception or SIGTERM too: SIGTERM is raised here as SystemExit while they run)."""
    loops = [subprocess.Popen(["sh", "-c", "while :; do :; done"], start_new_session=True) for _ in range(n)]
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield loops
    finally:
        signal.signal(signal.SIGTERM, previous)
        for loop in loops:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(loop.pid, signal.SIGKILL)
            loop.wait()


def run(command: list[str], busy: int, log: Path) -> dict:
    """The command beside ``busy`` busy loops, its output in ``log``: exit code, wall seconds, load
    average, summary line."""
    with log.open("w+") as out, busy_loops(busy):
        start = time.monotonic()
        code = subprocess.call(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        wall = time.monotonic() - start
        load = os.getloadavg()[0]
    return {"code": code, "wall": wall, "load": load, "summary": summary_line(log.read_text(errors="replace"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=2, help="how many busy loops run beside the command")
    parser.add_argument("--no-write", action="store_true", help="print the report only; do not append its figures to bench/results.jsonl")
    parser.add_argument("command", nargs="*", help="the command (default: the README's pytest command)")
    parser.add_argument("--log", type=Path, help="where the command's whole output goes (default: a new file in the temporary folder)")
    args = parser.parse_args()
    if args.busy < 0:
        parser.error(f"--busy: expected a count of busy loops (0 or more), got {args.busy}")
    command = args.command or DEFAULT_COMMAND
    log = args.log
    if log is None:
        fd, name = tempfile.mkstemp(prefix="suite-under-load-", suffix=".log")
        os.close(fd)
        log = Path(name)
    result = run(command, args.busy, log)
    sys.stdout.write(f"the command's whole output: {log}\n")
    shown = [Path(command[0]).name if command[0] == sys.executable else command[0], *command[1:]]
    body = f"`{' '.join(shown)}` beside {args.busy} busy loops on {os.cpu_count()} cores:\n\n" + table(
        ["busy loops", "exit code", "result", "wall s", "load average at the end (1 min)"],
        [[args.busy, result["code"], result["summary"] or "(no pytest summary)", round(result["wall"], 1), round(result["load"], 2)]],
    )
    sys.stdout.write(body + "\n")
    if not args.no_write:
        report("Test suite under load", body)
    sys.exit(0 if result["code"] == 0 else 1)


if __name__ == "__main__":
    main()
