"""bench.suite_under_load: pytest's summary line read from its output, and busy loops that end with the command."""

from __future__ import annotations

import os
import sys

import pytest

from bench.suite_under_load import busy_loops, main, run, summary_line


def test_the_summary_line_is_pytests_closing_counts():
    output = "....\nFAILED tests/x.py::t - assert 1 == 2\n= 1 failed, 1044 passed, 7 skipped, 87 warnings in 1156.51s (0:19:16) =\n"
    assert summary_line(output) == "1 failed, 1044 passed, 7 skipped, 87 warnings"
    assert summary_line("1045 passed, 7 skipped in 915.60s (0:15:15)\n") == "1045 passed, 7 skipped"
    assert summary_line("3 skipped, 1 deselected in 0.20s\n") == "3 skipped, 1 deselected"
    assert summary_line("Traceback (most recent call last):\nSystemExit: 2\n") == ""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_busy_loops_spin_while_the_command_runs_and_end_with_it_or_with_an_exception(tmp_path):
    log = tmp_path / "out.log"
    result = run([sys.executable, "-c", "print('= 2 passed in 0.01s =')"], busy=1, log=log)
    assert result["code"] == 0 and result["summary"] == "2 passed" and result["wall"] > 0
    assert log.read_text() == "= 2 passed in 0.01s =\n"
    with pytest.raises(RuntimeError), busy_loops(2) as loops:
        pids = [loop.pid for loop in loops]
        assert all(alive(pid) and loop.poll() is None for pid, loop in zip(pids, loops, strict=True))
        raise RuntimeError("the command failed")
    assert [loop.returncode for loop in loops] == [-9, -9]
    assert not any(alive(pid) for pid in pids)


def test_a_negative_count_of_busy_loops_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["suite_under_load.py", "--busy", "-1", "--no-write"])
    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 2 and "--busy: expected a count of busy loops (0 or more), got -1" in capsys.readouterr().err
