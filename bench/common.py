"""Shared by the benchmarks: machine facts and appending a result section to docs/benchmarks.md."""

from __future__ import annotations

import datetime
import platform
import random
import shlex
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = REPO / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Every figure here was measured by the command shown with it, on the device
shown with it. Nothing is estimated or copied from elsewhere. Re-run a
command to append a fresh section; older sections stay for comparison.
"""


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


def wrap_prose(text: str, width: int = 100) -> str:
    """Prose lines of a section wrapped at ``width`` (tests/unit/project/test_docs.py holds docs/ to 400 characters a
    line); table rows and code blocks are left as they are."""
    import textwrap

    out, code = [], False
    for line in text.split("\n"):
        code ^= line.startswith("```")
        if code or line.startswith(("|", "```")) or len(line) <= width:
            out.append(line)
        else:
            indent = "  " if line.startswith("- ") else ""
            out += textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


def append_section(title: str, body: str, device: str = "cpu", note: str = "") -> str:
    import torch

    section = wrap_prose(
        f"\n## {title}\n\n"
        f"- command: `{command_line()}`\n"
        f"- device: {device_name(device)}\n"
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}\n"
        f"- versions: torch {torch.__version__}, python {platform.python_version()}\n" + (f"- note: {note}\n" if note else "") + f"\n{body}\n"
    )
    BENCHMARKS_MD.parent.mkdir(exist_ok=True)
    if not BENCHMARKS_MD.exists():
        BENCHMARKS_MD.write_text(HEADER)
    with BENCHMARKS_MD.open("a") as f:
        f.write(section)
    return section


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
