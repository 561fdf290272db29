"""The stall watchdog's decisions in one process, with timeouts of a second: an async save's writes keep
alive only the phase that waits for them, a hang after the run's end is recorded and ends the process,
every rank names the rank behind and waits while a straggler moves (through a real TCPStore), and an
unreachable store leaves the line without its cross-rank part. The real runs are in tests/faults/test_stall.py."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist
from conftest import free_port
from shared import ENDS_WITHIN_S, TIMEOUT_S, steady_marks, watch

from core.runtime.marks import Marks
from core.runtime.peers import PeerView
from core.runtime.watchdog import EXIT_STALLED


def background_writer(marks: Marks, stop: threading.Event) -> threading.Thread:
    """An async save's writer: a block written every 10 ms, on a thread of its own, until ``stop``."""

    def write() -> None:
        while not stop.wait(0.01):
            marks.alive()

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_an_async_saves_writes_keep_alive_only_the_phase_that_waits_for_them(capfd):
    """While an async save's writer writes (blocks marked from its thread), a main thread that hangs
    in the data read is a stall after the timeout all the same: a block counts only for the phases
    that wait for it, so the hang is not hidden until the writes end. Waiting for that save to be written
    is kept alive by the same blocks."""
    marks = steady_marks()
    marks.progress("waiting for the async save of step 1 to be written", waits=True)
    writes_end = threading.Event()
    writer = background_writer(marks, writes_end)
    dog, ending = watch(marks)
    assert not ending.done.wait(3 * TIMEOUT_S), capfd.readouterr().err  # the writes are this phase's progress
    marks.progress("reading the data of step 2", 1)  # the main thread hangs here; the writer goes on
    assert ending.done.wait(ENDS_WITHIN_S) and writer.is_alive(), "the writer's blocks kept a hung data read alive"
    writes_end.set()
    dog.stop()
    assert ending.codes == [EXIT_STALLED]
    (code, reason, step, detail) = ending.statuses[0]
    assert (code, reason, step) == (EXIT_STALLED, "stalled", 1) and "reading the data of step 2 for" in detail, detail
    assert "rank 0: stalled: no progress for" in capfd.readouterr().err


def test_a_hang_after_the_runs_end_is_recorded_ends_the_process_and_keeps_that_record(capfd):
    """Teardown (destroying the process groups, say) after exit_status.json says ``completed``: the
    process is ended with the line and the stacks, but the record is not turned into a ``stalled``
    that launchers would restart."""
    marks = steady_marks()
    marks.recorded = "completed"  # core.runtime.watchdog.end_recorded, as core.preflight.run_files calls it
    marks.progress("after the run's end: destroying the process groups (destroy_process_group)")
    dog, ending = watch(marks)
    assert ending.done.wait(ENDS_WITHIN_S)
    dog.stop()
    err = capfd.readouterr().err
    assert ending.codes == [EXIT_STALLED] and ending.statuses == [], ending.statuses
    assert "after the run's end: destroying the process groups" in err and "exit_status.json keeps reason 'completed'" in err, err
    assert "Thread 0x" in err  # the stacks


@pytest.fixture
def store():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)

    def connect() -> dist.Store:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
        return dist.PrefixStore("plait/liveness/test/0/", client)

    yield connect
    del server


def settled_ender(view: PeerView) -> int | None:
    """The rank ``view`` reads as having ended the run, read once every request it queued before has
    run (its thread serves them in order), so that none is left to fail after the store is gone."""
    deadline = time.monotonic() + ENDS_WITHIN_S
    while time.monotonic() < deadline:
        if (ender := view.ended_by(wait_s=0.5)) is not None:
            return ender
        time.sleep(0.05)  # an earlier read still unanswered: ended_by returned at once
    return None


def test_every_rank_names_the_rank_behind_and_waits_while_a_straggler_moves(store, capfd):
    """Two ranks sharing a store. Rank 1 reads the data of step 2 slowly while rank 0 waits in the
    step (it is ahead in the loop): as long as rank 1 moves, rank 0 is not stalled, however long it
    waits. Once rank 1 stops moving, both end, and both lines name rank 1 and its data read."""
    timeout_s = 1.0  # a moving rank's record is at most 2 x timeout_s / 10 old; "moving" is under timeout_s / 2
    marks = [steady_marks(), steady_marks()]
    marks[1].progress("reading the data of step 2", 1)
    marks[0].progress("reading the data of step 2", 1)
    marks[0].progress("in step 2 (forward, backward, update)", 1)
    views = [PeerView(r, 2, store, every_s=timeout_s / 10) for r in (0, 1)]
    (dog0, end0), (dog1, end1) = watch(marks[0], 0, views[0], timeout_s), watch(marks[1], 1, views[1], timeout_s)
    moving_until = time.monotonic() + 4 * timeout_s
    while time.monotonic() < moving_until:  # rank 1's reads move on; rank 0 waits far past its timeout
        marks[1].alive()
        time.sleep(0.01)
    assert not end0.done.is_set() and not end1.done.is_set(), capfd.readouterr().err
    assert end0.done.wait(ENDS_WITHIN_S) and end1.done.wait(ENDS_WITHIN_S), capfd.readouterr().err
    dog0.stop()
    dog1.stop()
    enders = [settled_ender(view) for view in views]
    assert enders[0] == enders[1] and enders[0] in (0, 1), enders  # one rank ended the run as stalled; both read which
    err = capfd.readouterr().err
    assert "rank 0: no progress for" in err and "waiting for rank 1, which still moves (reading the data of step 2); not a stall yet" in err, err
    lines = {r: [line for line in err.splitlines() if f"rank {r}: stalled: " in line] for r in (0, 1)}
    assert "the rank furthest behind is rank 1: reading the data of step 2" in lines[0][0], lines
    assert "the rank furthest behind is rank 1 (this rank): reading the data of step 2" in lines[1][0], lines
    assert "rank 0 in step 2 (forward, backward, update)" in lines[1][0], lines
    (status,) = end0.statuses  # rank 0's write_status writes the file; rank 1's is a no-op in a real run
    assert status[1] == "stalled" and "the rank furthest behind is rank 1" in status[3]


def test_an_unreachable_store_leaves_the_line_without_the_cross_rank_part(capfd):
    """No rendezvous store answers: one warning, and the stall is still ended (its line lacks only
    what the other ranks were doing)."""
    port = free_port()

    def connect() -> dist.Store:
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=0.2), wait_for_workers=False)

    marks = steady_marks()
    view = PeerView(0, 2, connect, every_s=TIMEOUT_S / 10)
    dog, ending = watch(marks, 0, view)
    assert ending.done.wait(ENDS_WITHIN_S)
    dog.stop()
    deadline = time.monotonic() + ENDS_WITHIN_S
    while not view.broken and time.monotonic() < deadline:  # the connection's failure, said on the view's thread
        time.sleep(0.05)
    err = capfd.readouterr().err
    assert "cannot reach the rendezvous store" in err and "rank 0: stalled: no progress for" in err, err
    assert "furthest behind" not in err
