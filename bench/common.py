"""Shared by the benchmarks: machine facts, and reporting a result (printed, and its figures appended to
bench/results.jsonl)."""

from __future__ import annotations

import datetime
import platform
import random
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench import results

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A localhost port for a rendezvous that no other socket takes by chance meanwhile: one below
    the kernel's ephemeral range (where a port from ``bind(0)`` and every connecting socket, gloo's
    included, get theirs), checked free by binding it. (A port from the ephemeral range could be
    handed to another job's connection between this check and torchrun's bind: its clients then
    wait 60 s for a store that is not there.)"""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.SystemRandom()
    for _ in range(200):
        port = pick.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} on 127.0.0.1")


def device_name(device: str = "cpu") -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line() -> str:
    return "python -m " + "bench." + Path(sys.argv[0]).stem + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")


def table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:,.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def commit() -> str:
    """The checkout's short commit, ``+dirty`` when it has uncommitted changes; "" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else ""


def report(title: str, body: str, device: str = "cpu", note: str = "") -> list[dict]:
    """Append the figures of a result (``body``: the markdown tables and prose the bench printed) to
    bench/results.jsonl with its command, device, date, versions and commit, and print those facts
    (``python -m bench.results`` prints the rows)."""
    import torch

    facts = {
        "command": command_line(),
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": f"torch {torch.__version__}, python {platform.python_version()}",
        "commit": commit(),
    }
    rows = results.figures(title, body)
    for row in rows:
        row.update(facts)
        if note and row["value"] is None and row["name"] == title:
            row["note"] = f"{note}; {row['note']}"
    if note and not any(row["name"] == title for row in rows):
        rows.append({"name": title, "value": None, "unit": "", "note": note, **facts})
    results.append(rows)
    print(f"\n{title}: {len(rows)} rows appended to {results.RESULTS}\n" + "".join(f"- {k}: {v}\n" for k, v in facts.items()))
    return rows


def loader_rate(source, seq_len: int, micro_batch: int, batches: int, vocab_size: int | None = None) -> float:
    """Tokens/s that ``source``'s loader delivers to one rank over ``batches`` micro-batches, after a first
    one (which warms the page cache and the memory maps)."""
    from core.contract.protocols import LoaderSpec

    it = iter(source.loader(LoaderSpec(seq_len, micro_batch, 1, 0, 1, 42, vocab_size=vocab_size)))
    next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * micro_batch * seq_len / (time.perf_counter() - t0)


def synthetic_config(flavor: str, seq_len: int, micro_batch: int, device: str, out: str, **model) -> Path:
    """A temporary run config on synthetic random tokens (no data files), monitors and saves off."""
    import tempfile

    from core.config.files import dumps

    cfg = {
        "train": {
            "steps": 1,
            "global_batch_tokens": micro_batch * seq_len,
            "micro_batch": micro_batch,
            "device": device,
            "output_dir": out,
            "log_every": 1_000_000,
        },
        "model": {"name": "llama3", "flavor": flavor, **model},
        "data": {"name": "synthetic", "kind": "random", "seq_len": seq_len},
        "optimizer": {"name": "adamw"},
        "monitors": {"enabled": []},
        "checkpoint": {"at_end": False, "resume": "none", "keep_latest": 0},
    }
    path = Path(tempfile.mkdtemp(prefix="plait-bench-")) / "bench.toml"
    path.write_text(dumps(cfg))
    return path
