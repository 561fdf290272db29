"""The stall line names a rendezvous store that stops answering (a real TCPStore frozen under a running
watchdog). The watchdog's decisions in one process are in tests/unit/runtime/test_watchdog_unit.py, its
real runs in tests/faults/test_stall.py."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist
from conftest import free_port
from shared import ENDS_WITHIN_S, TIMEOUT_S, steady_marks, watch

from core.runtime.peers import PeerView


def test_a_store_that_stops_answering_is_named_in_the_stall_line(capfd):
    """On several nodes the store is served from rank 0's node. When that node is lost without a word
    (frozen here: the process serving the store is stopped), every read of it times out. The stall
    is ended all the same, and its line now says why it lacks the other ranks' phases: the store at
    host:port did not answer (that part of the line is never missing without a word)."""
    port = free_port()
    serve = f"import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); print('up', flush=True); time.sleep(300)"
    server = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "up\n"

        def connect() -> dist.Store:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=0.5), wait_for_workers=False)
            return dist.PrefixStore("plait/liveness/test/0/", client)

        marks = steady_marks()
        view = PeerView(0, 2, connect, every_s=TIMEOUT_S / 10, where=f"127.0.0.1:{port}")
        deadline = time.monotonic() + ENDS_WITHIN_S
        while view.store is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert view.store is not None and not view.broken
        os.kill(server.pid, signal.SIGSTOP)  # the store's node is gone: nothing answers, nothing is refused
        dog, ending = watch(marks, 0, view)
        assert ending.done.wait(ENDS_WITHIN_S)
        dog.stop()
    finally:
        server.kill()
        os.kill(server.pid, signal.SIGCONT)
        server.wait()
    err = capfd.readouterr().err
    (line,) = [line for line in err.splitlines() if "rank 0: stalled: no progress for" in line]
    assert f"the other ranks' phases are unknown: the rendezvous store at 127.0.0.1:{port} did not answer" in line, line
    assert "furthest behind" not in line and "it is served from rank 0's node, which may be the one lost" in line
    assert "the rendezvous store at 127.0.0.1" in ending.statuses[0][3]  # exit_status.json's detail says it too
