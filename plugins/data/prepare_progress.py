"""A data preparation's progress bar on stderr: bytes read of the input, documents, tokens,
tokens/s and the ETA; redrawn in place on a terminal, a full line now and then in a log."""

from __future__ import annotations

import math
import sys
import time


def _clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "--:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """The progress bar on stderr: bytes read of the input, documents, tokens, tokens/s and ETA.

    On a terminal one line is redrawn every ``interval`` seconds (default 0.2); elsewhere (a log
    file, a pipe) a full line is printed every ``interval`` seconds (default 10). The ETA is the
    input bytes left at the rate the bytes so far were read."""

    WIDTH = 20

    def __init__(self, total_bytes: int, files: int, interval: float | None = None, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval = interval if interval is not None else (0.2 if self.tty else 10.0)
        self.total, self.files = max(total_bytes, 1), files
        self.t0 = time.perf_counter()
        self.last = -math.inf
        self.drawn = False

    def update(self, done_bytes: float, docs: int, tokens: int, file_no: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < self.interval:
            return
        self.last = now
        elapsed = max(now - self.t0, 1e-9)
        frac = min(done_bytes / self.total, 1.0)
        filled = int(frac * self.WIDTH)
        eta = elapsed * (1 - frac) / frac if frac > 0 else None
        line = (
            f"prepare [{'#' * filled}{'.' * (self.WIDTH - filled)}] {frac:6.1%} {done_bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB"
            f" | file {file_no}/{self.files} | {docs:,} docs | {tokens:,} tokens | {tokens / elapsed:,.0f} tokens/s"
            f" | {_clock(elapsed)} elapsed, ETA {_clock(eta)}"
        )
        self.stream.write(f"\r{line}\x1b[K" if self.tty else f"{line}\n")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
