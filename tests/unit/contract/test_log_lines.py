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
