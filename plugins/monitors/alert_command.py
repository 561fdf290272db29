"""A user's shell command run on an event (``budget_guard``'s ``alert_command``) so that it holds
nothing of the run: no stdin, its output read here (never the rank's stdout and stderr), a session
of its own, and a time limit.

Started as the rank's child with the rank's streams, a command that hangs (a webhook that never
answers) or leaves a child behind would keep the pipe into ``launchers/remote.sh``'s ``tee`` open,
and the launcher would wait on it after the run ended. So the command (and what it started) is
ended after ``timeout_s`` with one warning, and when the run ends it gets at most
``END_GRACE_S`` more. A command that fails says so in one warning, with the end of its output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading

from core.api import log

END_GRACE_S = 5.0  # what a command still running when the run ends may still take


class DetachedCommand:
    """``command`` (a shell line) started now in a session of its own; a thread waits for it."""

    def __init__(self, command: str, env: dict[str, str], timeout_s: float, what: str) -> None:
        self.command, self.timeout_s, self.what = command, timeout_s, what
        self._ended = threading.Lock()
        self.proc = subprocess.Popen(
            command, shell=True, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.thread = threading.Thread(target=self._wait, name=f"plait-{what}", daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        try:
            output, _ = self.proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.end(f"did not finish within {self.timeout_s:g} s")
            return
        except (OSError, ValueError):  # the pipe went with the end below
            return
        if self.proc.returncode != 0:
            tail = output.decode(errors="replace").strip().splitlines()[-1:] if output else []
            log.warn(f"{self.what} {self.command!r} exited with code {self.proc.returncode}" + (f": {tail[0][:300]}" if tail else ""))

    def end(self, why: str) -> None:
        """Kill the command's whole session (what it started too), once, with one warning."""
        if not self._ended.acquire(blocking=False):
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its group outlives it while a child it left holds on
        except OSError:
            pass
        log.warn(f"{self.what} {self.command!r} {why}; ended it and what it started")

    def finish(self) -> None:
        """The run ends: wait ``END_GRACE_S`` at most, then end the command if it still runs."""
        self.thread.join(END_GRACE_S)
        if self.thread.is_alive():
            self.end(f"was still running {END_GRACE_S:g} s after the run ended")
