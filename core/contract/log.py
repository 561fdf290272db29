"""plait's one logger: rank-aware lines with the ``plait:`` prefix.

``info`` goes to stdout, ``note``, ``warn`` and ``error`` to stderr, each line in one write,
flushed at once (launchers and tests read the streams while the run goes on; ranks that share
torchrun's pipe never split each other's lines of up to 4 KiB, the pipe's atomic write). By default
only global rank 0 speaks, so an N-rank run prints each line once; pass
``all_ranks=True`` for what only one rank can know (its own data error).
``warn(..., once="key")`` prints a given warning once per process.

The rank comes from torchrun's ``RANK`` variable, so the logger works before
any process group exists.
"""

from __future__ import annotations

import os
import sys

_warned: set[str] = set()


def rank() -> int:
    """This process's global rank (torchrun's ``RANK``; 0 without one)."""
    return int(os.environ.get("RANK", 0))


def is_main() -> bool:
    """Is this global rank 0 (the one that writes run files and speaks)?"""
    return rank() == 0


def _emit(stream, text: str, all_ranks: bool) -> None:
    if all_ranks or is_main():
        stream.write(text + "\n")  # one write: another rank's line cannot land inside this one
        stream.flush()


def info(message: str, all_ranks: bool = False) -> None:
    """A progress line on stdout: ``plait: <message>``."""
    _emit(sys.stdout, f"plait: {message}", all_ranks)


def note(message: str, all_ranks: bool = False) -> None:
    """Information that must stay off stdout (``core.plan --json`` prints JSON there)."""
    _emit(sys.stderr, f"plait: {message}", all_ranks)


def warn(message: str, once: str | None = None, all_ranks: bool = False) -> None:
    """``plait: warning: <message>`` on stderr; with ``once``, only the first warning of that key
    in this process (for a condition that repeats every step)."""
    if once is not None:
        if once in _warned:
            return
        _warned.add(once)
    _emit(sys.stderr, f"plait: warning: {message}", all_ranks)


def error(message: str, all_ranks: bool = False) -> None:
    """``plait: error: <message>`` on stderr."""
    _emit(sys.stderr, f"plait: error: {message}", all_ranks)
