"""The stall watchdog: a rank in which nothing has progressed for ``train.stall_timeout_s`` ends the run.

``train.collective_timeout_s`` catches a rank that stops while the others wait for it in a
collective, after half an hour. When every rank hangs outside a collective (a data read on a dead
network mount, a deadlocked loader worker, a save to a hung file system, a monitor's call that
never returns) nothing fails at all, and the run would sit there, billed, until someone looked. So
the run marks its progress (:mod:`core.runtime.marks`): :func:`progress` when a phase of its main loop
begins, from the start to the process's exit (the data read of a step, the step, each monitor call,
each validation batch, each phase of a save, and teardown: the final save, waiting for an async
save, the monitors' ``plait_train_end``, destroying the process groups, stopping loader workers),
and :func:`alive` while a long phase is still moving (each block a save writes or a checksum check
reads, each tensor a load reads). Another thread's :func:`alive` (an async save's writer) keeps
alive only a phase that waits for it, never the main loop's own work.

A daemon thread per rank (:func:`start`) checks the time since the last mark that counts; past the
timeout (``STARTUP_FACTOR`` times it until this process has completed its first step: building,
resume checks, the first step's compiles) it

1. reads every rank's phase (:mod:`core.runtime.peers`); if a rank at or behind this one's place in the
   loop has moved within half the timeout, this one is waiting for a straggler: it goes on waiting,
2. logs one line naming its phase and how long it has lasted, and the rank furthest behind with
   what the others are doing,
3. dumps every thread's Python stack to stderr (:func:`dump_stacks`): where it hung,
4. has ``exit_status.json`` written (rank 0; reason ``stalled``, exit code 1), which launchers restart
   like a crash, from the last complete checkpoint, unless the run's end is already written there
   (:func:`end_recorded`: a hang in teardown keeps ``completed``, ``signal``...), waiting at most
   ``REPORT_S`` for all of it (stderr or the file may sit on the hung pipe or file system), and
5. tells the other ranks through the store (a rank that has had no progress for more than half the
   timeout ends with it), gives them a few seconds (``grace_s``: two of their looks, 2 s to
   ``REPORT_S``) to say where they are before this exit breaks their collectives, and ends the
   process with :func:`os._exit`.

Without :func:`start` (``stall_timeout_s = 0``, or a tool) nothing watches; a mark is a few assignments.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Callable

from core.contract import log
from core.contract.errors import tell_torchrun
from core.runtime.marks import Marks
from core.runtime.peers import PeerView, describe, waiting_for

STARTUP_FACTOR = 3  # the allowance until this process's first step has ended: building, resuming, compiling
EXIT_STALLED = 1  # restarted like a crash by launchers/remote.sh and launchers/k8s/entrypoint.sh
REPORT_S = 10.0  # the exit waits no longer for the line, the stacks and exit_status.json (a hung pipe or file system)

WriteStatus = Callable[[int, str, int, str], None]  # (exit code, reason, step, detail): exit_status.json (rank 0)


class Watchdog:
    """Watches ``marks`` on a daemon thread; ``end(code)`` ends the process (:func:`os._exit`)."""

    def __init__(
        self,
        marks: Marks,
        timeout_s: float,
        write_status: WriteStatus,
        rank: int = 0,
        view: PeerView | None = None,
        end: Callable[[int], None] = os._exit,
        grace_s: float | None = None,
    ) -> None:
        self.marks, self.timeout_s, self.write_status, self.rank, self.view, self.exit = marks, timeout_s, write_status, rank, view, end
        self.every_s = min(timeout_s / 10, 5.0)  # how often it looks
        if grace_s is None:  # two looks of the ranks waiting for this one, and at least 2 s (a loaded machine)
            grace_s = min(max(2 * self.every_s, 2.0), REPORT_S) if view is not None else 0.0
        self.grace_s = grace_s
        self.stopped = threading.Event()
        self.ended = threading.Event()  # a stall was declared: the line is out, the process is ending
        self.waiting_said: int | None = None  # the straggler this rank said it waits for

    def start(self) -> None:
        threading.Thread(target=self._watch, name="plait-stall-watchdog", daemon=True).start()

    def stop(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        while not self.stopped.wait(self.every_s) and not self.ended.is_set():
            self.check()

    def check(self) -> None:
        """One look: publish this rank's phase; end the run if it has stalled."""
        now, wall = time.monotonic(), time.time()
        marks, view = self.marks, self.view
        if view is not None:
            view.publish(marks.record(wall, now), now)
        limit = self.timeout_s if marks.steady else self.timeout_s * STARTUP_FACTOR
        idle = now - marks.last_moved()
        if idle <= limit / 2 or (view is None and idle <= limit):
            return
        if view is None:
            self._end(idle, "", None)
            return
        if idle <= limit:  # waiting for more than half the allowance: has another rank ended the run meanwhile?
            if (by := view.ended_by(self.every_s)) is not None:
                self._end(idle, f"rank {by} ended the run as stalled while this rank had no progress for over half the timeout; ", None)
            return
        view.publish(marks.record(wall, now), now, force=True)
        if self.waiting_said is not None:  # still waiting for that straggler? one key, not every rank's
            records = self.peers(view, [self.waiting_said, self.rank])
            if records and waiting_for(self.rank, records, time.time(), self.timeout_s / 2) is not None:
                return
        records = self.peers(view)
        straggler = waiting_for(self.rank, records, time.time(), self.timeout_s / 2) if records else None
        if straggler is None:
            self._end(idle, "", records)
        elif self.waiting_said != straggler and records:  # a rank at or behind this one's place still moves: not a stall
            self.waiting_said = straggler
            doing = records[straggler]["doing"]
            log.warn(
                f"rank {self.rank}: no progress for {idle:.0f} s, waiting for rank {straggler}, which still moves ({doing}); not a stall yet", all_ranks=True
            )

    def peers(self, view: PeerView, ranks: list[int] | None = None) -> dict[int, dict] | None:
        """Every rank's record (or those of ``ranks``), this one's as it is now; None: the store did not answer."""
        records = view.read(max(self.every_s, 1.0), ranks)
        if records is not None:
            records[self.rank] = self.marks.record(time.time(), time.monotonic())
        return records

    def _end(self, idle: float, follows: str, records: dict[int, dict] | None) -> None:
        if self.stopped.is_set() or self.ended.is_set():
            return
        self.ended.set()
        if self.view is not None:
            self.view.end()
            records = records if records is not None else self.peers(self.view)
        phase, marks = self.marks.phase, self.marks
        allowance = "" if marks.steady else f" x {STARTUP_FACTOR} until the first step ends"
        what = (
            f"{follows}no progress for {idle:.0f} s, {phase.doing} for {time.monotonic() - phase.since:.0f} s "
            f"(train.stall_timeout_s = {self.timeout_s:g}{allowance})"
        )
        if records and self.view is not None:
            what += "; " + describe(self.rank, records, self.view.world_size, time.time())
        elif self.view is not None:  # the store's host may be the node that is lost (rank 0's)
            what += f"; the other ranks' phases are unknown: {self.view.silence()}"
        kept = f"; the run's end was already recorded (exit_status.json keeps reason {marks.recorded!r})" if marks.recorded else ""
        line = f"rank {self.rank}: stalled: {what}"

        def report() -> None:  # stderr, torchrun's failure summary, the launchers' exit_status.json
            whose = "exit_status.json" if self.rank == 0 else "rank 0's exit_status.json"  # only rank 0 writes it
            restart = "" if marks.recorded else f" ({whose} reason 'stalled': a launcher restarts it from the last complete checkpoint)"
            log.error(f"{line}{kept}; every thread's stack follows; ending the process{restart}", all_ranks=True)
            try:
                dump_stacks()
            except (AttributeError, OSError, ValueError):  # no usable stderr: the line above has said it
                pass
            tell_torchrun(f"plait: error: {line}")
            if not marks.recorded:
                self.write_status(EXIT_STALLED, "stalled", phase.steps, what)

        reporter = threading.Thread(target=report, name="plait-stall-report", daemon=True)
        reporter.start()
        reporter.join(REPORT_S)
        time.sleep(self.grace_s)  # the ranks waiting for this one say where they are before its exit breaks their collectives
        self.exit(EXIT_STALLED)


def dump_stacks() -> None:
    """Every thread's Python stack (:func:`faulthandler.dump_traceback`) to stderr, each line in one
    write: the ranks share torchrun's pipe, and faulthandler writes a line in pieces, between which
    another rank's line would land (and no longer start a line)."""
    import tempfile

    try:
        f = tempfile.TemporaryFile()
    except OSError:  # no room for it (a full disk may be what hangs): straight to stderr, in faulthandler's writes
        faulthandler.dump_traceback(file=sys.stderr.fileno(), all_threads=True)
        return
    with f:
        faulthandler.dump_traceback(file=f.fileno(), all_threads=True)
        f.seek(0)
        for line in f.read().splitlines(keepends=True):
            os.write(sys.stderr.fileno(), line)


_marks = Marks()
_watchdog: Watchdog | None = None


def progress(doing: str, step: int | None = None, waits: bool = False) -> None:
    """The main loop is now ``doing`` (``"reading the data of step 12"``): the phase before it ended.
    ``step``: the steps completed so far (the loop's own marks; exit_status.json records it);
    ``waits``: the phase waits for work on other threads (an async save's writes), whose
    :func:`alive` marks then count as its progress."""
    _marks.progress(doing, step, waits)


def doing() -> str:
    """What the main loop is doing now (the phase of the last :func:`progress`), for a line about a failure."""
    return _marks.phase.doing


def alive() -> None:
    """The work in hand is still moving (a save wrote a block); any thread may call it."""
    _marks.alive()


def end_recorded(reason: str) -> None:
    """The run's end is written to exit_status.json (rank 0) with ``reason``: a stall from here on (in
    teardown) ends the process but keeps that record (a completed run is not restarted)."""
    _marks.recorded = reason


def stalled() -> bool:
    """This rank's watchdog has declared a stall: its exit_status.json record stands."""
    return _watchdog is not None and _watchdog.ended.is_set()


def start(timeout_s: float, write_status: WriteStatus, doing: str = "starting", rank: int = 0, world_size: int = 1) -> None:
    """Watch this process from now on, until it exits; ``timeout_s = 0``: do nothing. ``write_status``
    writes exit_status.json (rank 0's; a no-op elsewhere). With several ranks under torchrun, each
    publishes its phase for the others' stall lines (:class:`core.runtime.peers.PeerView`)."""
    global _watchdog
    if timeout_s <= 0:
        return
    _marks.owner = threading.get_ident()
    progress(doing)
    view = PeerView.from_env(rank, world_size, every_s=timeout_s / 10)
    _watchdog = Watchdog(_marks, timeout_s, write_status, rank, view)
    _watchdog.start()


def stop() -> None:
    """Stop watching (a tool or a test that started it)."""
    if _watchdog is not None:
        _watchdog.stop()
