"""bench.suite_processes' reading of the kernel's accounting records and its attribution of processes."""

from __future__ import annotations

import pytest

from bench.suite_processes import ACCT_V3, attribute, comp_t, kind_of, read_accounting, report


def record(pid: int, ppid: int, utime: int, stime: int, comm: bytes, version: int = 3) -> bytes:
    return ACCT_V3.pack(0, version, 0, 0, 0, 0, pid, ppid, 0, 0.0, utime, stime, 0, 0, 0, 0, 0, 0, comm)


def test_records_decode_with_comp_t_times():
    assert comp_t(250) == 250 and comp_t((1 << 13) | 100) == 800 and comp_t((2 << 13) | 3) == 192
    rows = read_accounting(record(10, 1, 250, (1 << 13) | 100, b"python") + record(11, 10, 0, 7, b"tee"))
    assert rows == [{"pid": 10, "ppid": 1, "cpu": 10.5, "comm": "python"}, {"pid": 11, "ppid": 10, "cpu": 0.07, "comm": "tee"}]
    with pytest.raises(ValueError, match="version 2, expected 3"):
        read_accounting(record(10, 1, 0, 0, b"x", version=2))


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["python", "-m", "torch.distributed.run", "--standalone", "-m", "core.train"], "torchrun"),
        (["python", "-u", "-m", "core.train", "--config", "x.toml"], "core.train rank under torchrun"),
        (["python", "-X", "importtime", "-m", "core.plan"], "python -m core.plan"),
        (["python", "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"], "pytest-xdist worker"),
        (["python", "-c", "from multiprocessing.forkserver import main; main(6)"], "multiprocessing fork server"),
        (["python", "-", "--x"], "python - (a script on stdin: launcher checks)"),
        (["python", "/repo/tests/prestarted.py", "--serve"], "warm interpreter (tests/prestarted.py)"),
        (["python", "/tmp/worker.py"], "python script"),
    ],
)
def test_a_started_interpreter_is_named_by_its_command_line(argv, kind):
    assert kind_of(argv) == kind


def test_forks_count_under_their_nearest_started_ancestor_and_tests_are_kept_apart_from_warm_interpreters():
    acct = [
        {"pid": 2, "ppid": 1, "cpu": 3.0, "comm": "python"},  # torchrun, started for a test
        {"pid": 3, "ppid": 2, "cpu": 5.0, "comm": "python"},  # a rank it started
        {"pid": 4, "ppid": 3, "cpu": 1.0, "comm": "python"},  # forked by the rank (a data worker)
        {"pid": 5, "ppid": 3, "cpu": 0.5, "comm": "gcc"},  # a program the rank ran
        {"pid": 6, "ppid": 1, "cpu": 2.0, "comm": "python"},  # a warm interpreter
        {"pid": 7, "ppid": 6, "cpu": 0.5, "comm": "python"},  # its plait warm interpreter
        {"pid": 8, "ppid": 7, "cpu": 0.8, "comm": "python"},  # a command forked from that
        {"pid": 9, "ppid": 1, "cpu": 0.1, "comm": "bash"},  # no start record, no recorded ancestor
    ]
    starts = [
        {"pid": 2, "ppid": 1, "argv": ["python", "-m", "torch.distributed.run"], "test": "tests/t.py::test_a (call)"},
        {"pid": 3, "ppid": 2, "argv": ["python", "-u", "-m", "core.train"], "test": "tests/t.py::test_a (call)"},
        {"pid": 6, "ppid": 1, "argv": ["python", "tests/prestarted.py", "--serve"], "test": "tests/t.py::test_b (call)"},
    ]
    rows = {r["pid"]: (r["kind"], r["test"]) for r in attribute(acct, starts)}
    assert rows[2] == ("torchrun", "tests/t.py::test_a") and rows[3] == ("core.train rank under torchrun", "tests/t.py::test_a")
    assert rows[4] == ("fork of core.train rank under torchrun", "tests/t.py::test_a") and rows[5] == ("exe gcc", "tests/t.py::test_a")
    assert rows[6] == ("warm interpreter (tests/prestarted.py)", None) and rows[8] == ("fork of fork of warm interpreter (tests/prestarted.py)", None)
    assert rows[9] == ("exe bash", None)
    text = report(attribute(acct, starts), wall_s=4.0, code=0, command=["python", "-m", "pytest"])
    assert "12.9 CPU s in 8 processes (3.23 cores busy on average)" in text
    assert "| `tests/t.py::test_a` | 9.5 |" in text and "test_b" not in text
