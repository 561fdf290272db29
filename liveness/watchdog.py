"""The stall watchdog: a run in which nothing has progressed for ``train.stall_timeout_s`` is ended.

``train.collective_timeout_s`` catches a rank that stops while the others wait for it in a
collective. When every rank hangs outside a collective (a data read on a dead network mount, a
deadlocked loader worker, a save to a hung file system, a monitor's call that never returns)
nothing fails, and the run would sit there, billed, until someone looked. So the run marks its
progress: :func:`progress` when a phase begins (the one before it ended: the data read of a step,
the step, each monitor call, each validation batch, each phase of a save) and :func:`alive` while a
long phase is still moving (each block a save writes or a checksum check reads, each tensor a load
reads; from any thread). A daemon thread per rank
(:func:`start`) checks the time since the last mark; past the timeout (``STARTUP_FACTOR`` times it
until this process has completed its first step: building, resume checks, the first step's
compiles) it

1. logs one line naming the phase and how long it has lasted,
2. dumps every thread's Python stack to stderr (:func:`faulthandler.dump_traceback`): where it hung,
3. has ``exit_status.json`` written (rank 0; reason ``stalled``, exit code 1), which launchers restart
   like a crash, from the last complete checkpoint (waiting at most ``REPORT_S`` for all three: stderr
   or the file may sit on the hung pipe or file system), and
4. ends the process with :func:`os._exit`, so that torchrun ends the other ranks.

Each rank sees only its own progress: time it spends inside a phase waiting for the other ranks (a
save whose shares differ, a straggler) counts. A mark is a few assignments; without :func:`start`
(``stall_timeout_s = 0``, or a tool) nothing watches.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Callable

from core import log
from core.errors import tell_torchrun

STARTUP_FACTOR = 3  # the allowance until this process's first step has ended: building, resuming, compiling
EXIT_STALLED = 1  # restarted like a crash by launchers/remote.sh and launchers/k8s/entrypoint.sh
REPORT_S = 10.0  # the exit waits no longer for the line, the stacks and exit_status.json (a hung pipe or file system)

_phase: tuple[float, str, int] = (time.monotonic(), "starting", 0)  # (since, doing, steps completed)
_alive = time.monotonic()  # the last mark of either kind
_first_step: int | None = None  # the steps completed at this process's first mark that counted them
_steady = False  # this process has completed a step: the plain timeout applies
_stop = threading.Event()


def progress(doing: str, step: int | None = None) -> None:
    """The run is now ``doing`` (``"reading the data of step 12"``): the phase before it ended.
    ``step``: the steps completed so far (exit_status.json records it)."""
    global _phase, _alive, _first_step, _steady
    now = time.monotonic()
    if step is not None:
        _first_step = step if _first_step is None else _first_step
        _steady = _steady or step > _first_step
    _phase = (now, doing, _phase[2] if step is None else step)
    _alive = now


def alive() -> None:
    """The phase in hand is still moving (a save wrote a block); any thread may call it."""
    global _alive
    _alive = time.monotonic()


def start(timeout_s: float, write_status: Callable[[int, str, int, str], None], doing: str = "starting") -> None:
    """Watch this process from now on; ``timeout_s = 0``: do nothing. ``write_status(exit_code, reason,
    step, detail)`` writes exit_status.json (rank 0's; a no-op elsewhere)."""
    if timeout_s <= 0:
        return
    _stop.clear()
    progress(doing)
    threading.Thread(target=_watch, args=(timeout_s, write_status), name="plait-stall-watchdog", daemon=True).start()


def stop() -> None:
    """The run is over (its exit status is written): stop watching."""
    _stop.set()


def _watch(timeout_s: float, write_status: Callable[[int, str, int, str], None]) -> None:
    while not _stop.wait(min(timeout_s / 10, 5.0)):
        limit = timeout_s if _steady else timeout_s * STARTUP_FACTOR
        idle = time.monotonic() - _alive
        if idle > limit and not _stop.is_set():
            _end(idle, timeout_s, write_status)


def _end(idle: float, timeout_s: float, write_status: Callable[[int, str, int, str], None]) -> None:
    since, doing, step = _phase
    allowance = "" if _steady else f" x {STARTUP_FACTOR} until the first step ends"
    what = f"no progress for {idle:.0f} s, {doing} for {time.monotonic() - since:.0f} s (train.stall_timeout_s = {timeout_s:g}{allowance})"
    line = f"rank {log.rank()}: stalled: {what}"

    def report() -> None:  # stderr, torchrun's failure summary, the launchers' exit_status.json
        log.error(
            f"{line}; every thread's stack follows; ending the run (exit_status.json reason 'stalled': a launcher restarts it from the last complete checkpoint)",
            all_ranks=True,
        )
        try:
            faulthandler.dump_traceback(file=sys.stderr.fileno(), all_threads=True)
        except (AttributeError, OSError, ValueError):  # no usable stderr: the line above has said it
            pass
        tell_torchrun(f"plait: error: {line}")
        write_status(EXIT_STALLED, "stalled", step, what)

    reporter = threading.Thread(target=report, name="plait-stall-report", daemon=True)
    reporter.start()
    reporter.join(REPORT_S)
    os._exit(EXIT_STALLED)
