"""A stop asked for by a signal: SIGTERM (a pre-emption, a scheduler's time limit), SIGINT (Ctrl-C)
and SIGHUP (a closed terminal, which torchrun forwards).

The handler only records the first one; the loop reads :attr:`StopSignals.received` at its next
step boundary, where every rank agrees on it and the run stops with a checkpoint
(:mod:`core.loop.stop_policy`). One Ctrl-C can reach a rank more than once (from the terminal, and
forwarded by the launcher): signals within ``SIGNAL_WINDOW_S`` of the first are the same stop; a
Ctrl-C after that window stops at once (``KeyboardInterrupt``).
"""

from __future__ import annotations

import signal
import time
from typing import Any

SIGNAL_WINDOW_S = 3.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignals:
    """The first stop signal this process received, if any."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._at = 0.0

    def install(self) -> None:
        """Handle the stop signals in this process (the main thread) from now on."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: Any = None) -> None:
        """The handler: record the first signal; a deliberate second Ctrl-C raises KeyboardInterrupt."""
        if self.received is not None:
            if signum == signal.SIGINT and time.monotonic() - self._at > SIGNAL_WINDOW_S:
                raise KeyboardInterrupt
            return  # the same stop, delivered again (terminal and launcher)
        self.received = signum
        self._at = time.monotonic()
