"""Where a command's CPU time goes, process by process: the test suite's, by default.

The command runs with the kernel's process accounting on (``acct(2)``: one record per ended process,
with its pid, its parent's pid, its CPU time and its command name) and with a start hook in this
interpreter's site-packages (a ``.pth`` file: each Python interpreter that starts appends its pid, its
parent's pid, its command line and ``PYTEST_CURRENT_TEST`` to a file). A process forked without exec
(from the tests' warm interpreters, multiprocessing's fork server) has no start record of its own and
is counted as a fork of its nearest ancestor that has one. The report: CPU seconds by kind of process,
and the tests whose fresh interpreters (torchrun jobs, launcher scripts, commands that cannot fork from a
warm interpreter) cost the most.

Linux only, as root (``acct(2)``), with nothing else running: the kernel accounts every process that ends.

    python -m bench.suite_processes [--no-write] [-- python -m pytest -q -n 3 --dist worksteal]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.common import REPO, table
from bench.common import report as record

DEFAULT_COMMAND = [sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist", "worksteal"]

ACCT_V3 = struct.Struct("<BBHIIIIIIf8H16s")
"""``struct acct_v3`` (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime,
then utime, stime, mem, io, rw, minflt, majflt, swaps as ``comp_t`` and the command name (16 bytes)."""
AHZ = 100  # the clock ticks of acct_v3's times

HOOK = (
    "import os, sys, json\n"
    "try:\n"
    "    with open({path!r}, 'a') as f:\n"
    "        f.write(json.dumps({{'pid': os.getpid(), 'ppid': os.getppid(), 'argv': [a[:300] for a in sys.orig_argv[:12]],"
    " 'test': os.environ.get('PYTEST_CURRENT_TEST')}}) + '\\n')\n"
    "except Exception:\n"
    "    pass\n"
)


def comp_t(value: int) -> int:
    """A ``comp_t``: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def read_accounting(data: bytes) -> list[dict]:
    """The records of an ``acct_v3`` file: pid, ppid, cpu (seconds, user + system) and comm."""
    rows = []
    for offset in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        f = ACCT_V3.unpack_from(data, offset)
        if f[1] != 3:
            raise ValueError(f"process accounting record at byte {offset} has version {f[1]}, expected 3 (acct_v3)")
        rows.append({"pid": f[6], "ppid": f[7], "cpu": (comp_t(f[10]) + comp_t(f[11])) / AHZ, "comm": f[18].split(b"\0")[0].decode(errors="replace")})
    return rows


def kind_of(argv: list[str]) -> str:
    """What a Python interpreter started as, from its command line (``sys.orig_argv``)."""
    args = argv[1:]
    while args and (args[0] in ("-u", "-B", "-E", "-s", "-I") or args[0].startswith("-X")):
        args = args[2:] if args[0] == "-X" else args[1:]
    if not args:
        return "python"
    if args[0] == "-m" and len(args) > 1:
        return {"torch.distributed.run": "torchrun", "core.train": "core.train rank under torchrun"}.get(args[1], f"python -m {args[1]}")
    if args[0] == "-c" and len(args) > 1:
        code = args[1]
        for mark, name in [
            ("exec(eval(sys.stdin.readline()))", "pytest-xdist worker"),
            ("multiprocessing.forkserver", "multiprocessing fork server"),
            ("multiprocessing.spawn", "multiprocessing spawned process"),
            ("multiprocessing.resource_tracker", "multiprocessing resource tracker"),
        ]:
            if mark in code:
                return name
        return "python -c (other)"
    if args[0] == "-":
        return "python - (a script on stdin: launcher checks)"
    if args[0].endswith("prestarted.py"):
        return "warm interpreter (tests/prestarted.py)"
    return "python script"


def attribute(acct: list[dict], starts: list[dict]) -> list[dict]:
    """Each accounted process with its kind and the test it was started for (None if not known): an
    interpreter by its start record; a fork (no record) as ``fork of`` its nearest recorded ancestor;
    any other program as ``exe <comm>``. A fork of a warm interpreter is not given a test (the warm
    interpreter was started by whichever test came first)."""
    started = {s["pid"]: s for s in starts}
    parent = {r["pid"]: r["ppid"] for r in acct}
    out = []
    for r in acct:
        pid, forks = r["pid"], 0
        while pid not in started and pid in parent and forks < 64:
            pid, forks = parent[pid], forks + 1
        if pid in started:
            kind = kind_of(started[pid]["argv"])
            test = None if kind.startswith(("warm", "pytest")) else started[pid].get("test")
            if forks:
                python = r["comm"].startswith(("python", "pt_", "pytest")) or r["comm"] in ("", "torchrun")
                kind = ("fork of " * forks) + kind if python else f"exe {r['comm']}"
        else:
            kind, test = f"exe {r['comm']}", None
        out.append({**r, "kind": kind, "test": test.rsplit(" (", 1)[0] if test else None})
    return out


def report(rows: list[dict], wall_s: float, code: int, command: list[str]) -> str:
    total = sum(r["cpu"] for r in rows)
    by_kind, count = Counter(), Counter()
    for r in rows:
        by_kind[r["kind"]] += r["cpu"]
        count[r["kind"]] += 1
    kinds = [[k, round(v, 1), count[k], round(v / count[k], 2), f"{100 * v / total:.1f}%"] for k, v in by_kind.most_common() if v >= 1.0]
    by_test = Counter()
    for r in rows:
        if r["test"]:
            by_test[r["test"]] += r["cpu"]
    tests = [[f"`{t}`", round(v, 1)] for t, v in by_test.most_common(20)]
    return (
        f"`{shlex.join(command)}`: exit code {code}, {wall_s:.1f} s wall, {total:.1f} CPU s in {len(rows)} processes "
        f"({total / wall_s:.2f} cores busy on average).\n\n"
        "By kind (kinds under 1 CPU s left out; `fork of` a kind: forked from such a process without exec):\n\n"
        + table(["process", "CPU s", "processes", "CPU s each", "share"], kinds)
        + "\n\nThe tests whose own processes (not forks of a warm interpreter) cost the most CPU seconds:\n\n"
        + table(["test", "CPU s"], tests)
    )


def run(command: list[str]) -> tuple[list[dict], float, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    work = Path(tempfile.mkdtemp(prefix="plait-suite-processes-"))
    accounting, start_log = work / "pacct", work / "starts.jsonl"
    accounting.touch()
    hook = Path(sysconfig.get_paths()["purelib"]) / "plait_bench_process_starts.pth"
    hook.write_text("import os; exec(" + repr(HOOK.format(path=str(start_log))) + ", {})\n")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the hook and the accounting are undone on SIGTERM too
    try:
        if libc.acct(str(accounting).encode()) != 0:
            raise SystemExit(
                f"bench.suite_processes: acct({accounting}) failed: {os.strerror(ctypes.get_errno())} (needs root and a Linux kernel with BSD process accounting)"
            )
        started = time.perf_counter()
        try:
            code = subprocess.call(command, cwd=REPO)
        finally:
            wall = time.perf_counter() - started
            libc.acct(None)
    finally:
        hook.unlink()
    starts = [json.loads(line) for line in start_log.read_text().splitlines() if line.strip()] if start_log.exists() else []
    return attribute(read_accounting(accounting.read_bytes()), starts), wall, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print the report only; do not append its figures to bench/results.jsonl")
    parser.add_argument("command", nargs="*", help="the command to account (default: the README's pytest command)")
    args = parser.parse_args()
    command = args.command or DEFAULT_COMMAND
    rows, wall, code = run(command)
    body = report(rows, wall, code, [Path(command[0]).name if command[0] == sys.executable else command[0], *command[1:]])
    sys.stdout.write(body + "\n")
    if not args.no_write:
        record("Test suite: where the CPU goes, process by process", body)


if __name__ == "__main__":
    main()
