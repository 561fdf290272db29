"""A rank's progress marks: the phase its main loop is in, and the last time each source moved.

There are two sources of progress. The main loop's thread (the one that started the watchdog)
marks a phase when it begins (:meth:`Marks.progress`) and may mark that the phase is still moving
(:meth:`Marks.alive`: a block a sync save wrote, a tensor a load read). Any other thread's
:meth:`Marks.alive` (an async save's writer, DCP's I/O threads) is background progress: it keeps
alive only a phase that waits for that work (``waits=True``: waiting for an async save to be
written, a save's writing), never the data read, the step's compute, a monitor call or teardown,
which it says nothing about.

``place`` is where the main loop is, comparable across ranks: ``(steps completed, n)``, where ``n``
counts the loop's own marks (those that carry ``step``: after the step, its data read, its compute)
since the count of steps last changed. Every rank passes those marks in the same order, so the
rank with the lowest ``place`` is the one the others wait for. Marks are a few assignments: cheap
enough for every block written.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Phase:
    doing: str  # "reading the data of step 12"
    since: float  # when it began (the marks' clock)
    steps: int  # steps completed (exit_status.json records it)
    place: tuple[int, int]  # where the main loop is (steps completed, the loop's marks since)
    waits: bool  # it waits for work on other threads: their alive() marks are its progress


class Marks:
    """One rank's progress. ``clock``: monotonic seconds (a test may pass its own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.owner = threading.main_thread().ident  # the main loop's thread (start() sets it)
        now = clock()
        self.phase = Phase("starting", now, 0, (-1, 0), False)
        self.moved = now  # the main thread's last mark
        self.background = float("-inf")  # another thread's last alive()
        self.first_step: int | None = None  # steps completed at the first mark that counted them
        self.steady = False  # a step has been completed since: the plain timeout applies
        self.recorded: str | None = None  # exit_status.json's reason once the run's end is written

    def progress(self, doing: str, step: int | None = None, waits: bool = False) -> None:
        """The main loop is now ``doing``; the phase before it ended. ``step``: steps completed
        (the loop's own marks); ``waits``: the phase waits for work on other threads."""
        if threading.get_ident() != self.owner:  # only the main loop has phases
            self.alive()
            return
        now, old = self.clock(), self.phase
        steps, place = old.steps, old.place
        if step is not None:
            self.first_step = step if self.first_step is None else self.first_step
            self.steady = self.steady or step > self.first_step
            steps, place = step, (step, old.place[1] + 1 if step == old.place[0] else 0)
        self.phase = Phase(doing, now, steps, place, waits)
        self.moved = now

    def alive(self) -> None:
        """The work in hand is still moving (a block written, a tensor read); any thread may call it."""
        if threading.get_ident() == self.owner:
            self.moved = self.clock()
        else:
            self.background = self.clock()

    def last_moved(self) -> float:
        """The last mark that counts for the phase in hand."""
        phase = self.phase
        return max(self.moved, self.background) if phase.waits else self.moved

    def record(self, wall_now: float, now: float) -> dict:
        """What other ranks see of this one (wall times: other hosts' monotonic clocks differ)."""
        phase = self.phase
        return {
            "doing": phase.doing,
            "place": list(phase.place),
            "since": round(wall_now - (now - phase.since), 3),
            "moved": round(wall_now - (now - self.last_moved()), 3),
        }
