"""The named points of a checkpoint save, where a test or a tool acts on it (kills a rank, pauses,
damages a file); plait itself installs none.

A :class:`core.checkpoint.checkpointer.Checkpointer` and its collaborators call the methods of
:class:`SavePoints` as a save of ``step`` into the folder ``path`` reaches them, in this order:

==================================  ======================================================================
``started(step)``                   every rank: the save's own work begins (after the save before it
                                    was committed), before its NaN/inf check
``claimed(step, path)``             rank 0: the step folder and its ``LINEAGE`` exist (or the save was
                                    skipped: another run's checkpoint is there)
``before_commit(step, path)``       every rank: every rank's shards and ``.metadata`` are written;
                                    rank 0 commits next
``state_written(step, path)``       rank 0: ``state.json`` is on disk
``writing_marker(step, path, t)``   rank 0: ``COMMITTED`` (text ``t``) is written next, to a temporary
                                    name that is fsynced and renamed
``committed(step, path)``           rank 0: ``COMMITTED`` is in place; the checkpoint root's fsync and
                                    pruning come next
``after_commit(step, path)``        every rank: the commit and pruning are done, ``on_saved`` was called
==================================  ======================================================================

A point runs in the thread that saves; whatever it raises fails the save as that step would.
:func:`observe` has every Checkpointer made afterwards in this process call an observer's points
(``tests/seams/sitecustomize.py`` does so in a run's processes); a Checkpointer can also be given
its own (its ``points`` argument). Shown by tests/faults/test_kill_points.py and tests/faults/test_integrity.py.
"""

from __future__ import annotations

from pathlib import Path


class SavePoints:
    """The named points of a save; each does nothing here. Subclass it and override the points you need."""

    def started(self, step: int) -> None:
        pass

    def claimed(self, step: int, path: Path) -> None:
        pass

    def before_commit(self, step: int, path: Path) -> None:
        pass

    def state_written(self, step: int, path: Path) -> None:
        pass

    def writing_marker(self, step: int, path: Path, text: str) -> None:
        pass

    def committed(self, step: int, path: Path) -> None:
        pass

    def after_commit(self, step: int, path: Path) -> None:
        pass


class ObservedPoints(SavePoints):
    """Each point of every observer in ``observers``, in the order they were installed."""

    def __init__(self, observers: list[SavePoints]) -> None:
        self.observers = observers

    def started(self, step: int) -> None:
        for o in self.observers:
            o.started(step)

    def claimed(self, step: int, path: Path) -> None:
        for o in self.observers:
            o.claimed(step, path)

    def before_commit(self, step: int, path: Path) -> None:
        for o in self.observers:
            o.before_commit(step, path)

    def state_written(self, step: int, path: Path) -> None:
        for o in self.observers:
            o.state_written(step, path)

    def writing_marker(self, step: int, path: Path, text: str) -> None:
        for o in self.observers:
            o.writing_marker(step, path, text)

    def committed(self, step: int, path: Path) -> None:
        for o in self.observers:
            o.committed(step, path)

    def after_commit(self, step: int, path: Path) -> None:
        for o in self.observers:
            o.after_commit(step, path)


_observers: list[SavePoints] = []


def observe(points: SavePoints) -> None:
    """Have every Checkpointer made from now on in this process call ``points`` too."""
    _observers.append(points)


def observed() -> SavePoints:
    """The points a new Checkpointer calls by default: those of every observer installed so far."""
    return ObservedPoints(list(_observers))
