"""plait's logger writes each line with one write, so ranks that share torchrun's pipe keep their lines whole."""

from __future__ import annotations

import io


class Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_every_line_is_one_write_of_the_line_and_its_newline(monkeypatch):
    from core.contract import log

    out, err = Writes(), Writes()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setenv("RANK", "1")
    log.error("rank 1: stalled: no progress", all_ranks=True)
    log.warn("only rank 0 says this")
    log.info("step 3", all_ranks=True)
    assert err.calls == ["plait: error: rank 1: stalled: no progress\n"]
    assert out.calls == ["plait: step 3\n"]


def test_a_stall_dumps_every_threads_stack_one_whole_line_per_write(monkeypatch):
    """The watchdog's stack dump (faulthandler's text) reaches stderr a line per write, so another
    rank's line written meanwhile to the same pipe never lands inside one of its lines."""
    import os
    import sys

    from core.runtime import watchdog

    writes: list[bytes] = []
    real = os.write

    def record(fd: int, data: bytes) -> int:
        if fd == sys.stderr.fileno():
            writes.append(bytes(data))
            return len(data)
        return real(fd, data)

    monkeypatch.setattr(os, "write", record)
    watchdog.dump_stacks()
    assert any(w.startswith((b"Thread 0x", b"Current thread 0x")) for w in writes) and any(b"in test_a_stall_dumps_every_threads_stack" in w for w in writes), (
        writes
    )
    assert all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes), writes
