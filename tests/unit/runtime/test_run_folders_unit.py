"""The run-folder lock record (``plait.lock``): its holder renews it and marks a clean end, a record
read while it is renewed always parses, ``plan`` says at once that a folder looks held from another
host, a lock file that is not a plain file is refused in one line, and a fresh record is read once
(a half-written one again)."""

from __future__ import annotations

import json

import pytest
from conftest import run_here, write_tiny_config
from shared import THEIRS


def test_a_holder_renews_its_record_and_marks_a_clean_end(tmp_path, monkeypatch):
    import time

    from core.runtime import ownership

    monkeypatch.setattr(ownership, "LEASE_S", 0.05)
    monkeypatch.setattr(ownership, "_record", {})
    monkeypatch.setattr(ownership, "_renewing", None)  # a renewing thread of an earlier test waits its 10 s
    ownership.lock_run_folders([tmp_path])
    try:
        first = json.loads((tmp_path / "plait.lock").read_text())
        deadline = time.monotonic() + 300  # three renewals: a wait on the file, long only on a loaded machine
        while (later := json.loads((tmp_path / "plait.lock").read_text()))["renewals"] < first["renewals"] + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert later["renewals"] >= first["renewals"] + 3 and later["pid"] == first["pid"] and "released" not in later, (first, later)
    finally:
        ownership.release_run_folders(ended=True)
    assert json.loads((tmp_path / "plait.lock").read_text())["released"] is True


def test_a_record_read_while_its_holder_renews_it_always_parses(tmp_path, monkeypatch):
    """A renewal writes the record over the one before in one write, padded, and never leaves the file
    empty: a start on another host that read an empty record would take the folder for one never
    held (renewing every 0.5 ms here, to read it mid-renewal often)."""
    import time

    from core.runtime import ownership

    monkeypatch.setattr(ownership, "LEASE_S", 0.0005)
    monkeypatch.setattr(ownership, "_record", {})
    monkeypatch.setattr(ownership, "_renewing", None)
    ownership.lock_run_folders([tmp_path])
    reads, unparsed, renewals = 0, 0, 0
    try:
        deadline = time.monotonic() + 300  # reads until 100 renewals went by: long only on a loaded machine
        while renewals <= 100 and time.monotonic() < deadline:
            reads += 1
            try:
                renewals = json.loads((tmp_path / "plait.lock").read_text())["renewals"]
            except ValueError:
                unparsed += 1
    finally:
        ownership.release_run_folders(ended=True)
    assert renewals > 100 and unparsed == 0, (reads, unparsed, renewals)


def test_plan_says_a_folder_looks_held_from_another_host_without_waiting(tmp_path):
    """``core.plan`` looks without claiming: it said nothing of another host's record, renewed and never
    released, where a start watches the record for two lease periods and stops if it is renewed."""
    cfg = write_tiny_config(tmp_path, steps=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "plait.lock").write_text(json.dumps(THEIRS) + "\n")
    r = run_here("core.plan", "--config", str(cfg))
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [x for x in r.stderr.splitlines() if "looks held" in x]
    assert line.startswith(f"plait: warning: run folder {out} looks held by pid 4242 on host node-b (its record in plait.lock renewed "), line
    assert "a start waits 21 s to see whether it is still renewed" in line, line
    assert json.loads((out / "plait.lock").read_text()) == THEIRS  # a look only
    (out / "plait.lock").write_text(json.dumps({**THEIRS, "released": True}) + "\n")  # a clean end: nothing to say
    r = run_here("core.plan", "--config", str(cfg))
    assert r.returncode == 0 and "looks held" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("lock_file", ["a_link", "a_folder"])
def test_a_lock_file_that_is_not_a_plain_file_is_refused_in_one_line(tmp_path, lock_file):
    """``plait.lock`` a symbolic link: the start opened it through the link and wrote its record over the
    file it points to (a user's notes, another run's lock). A folder there: ``core.plan`` said nothing,
    and the start failed. Both are refused now, by the plan and the start, in one line (exit code 2)."""
    cfg = write_tiny_config(tmp_path, steps=2)
    out = tmp_path / "out"
    out.mkdir()
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    if lock_file == "a_link":
        (out / "plait.lock").symlink_to(notes)
    else:
        (out / "plait.lock").mkdir()
    for module in ("core.plan", "core.train"):
        r = run_here(module, "--config", str(cfg))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (module, r.stderr[-2000:])
        what = f"plait.lock is a symbolic link (to {notes})" if lock_file == "a_link" else "plait.lock is not a plain file"
        assert f"run folder {out}: {what}" in r.stderr, (module, r.stderr)
    assert notes.read_text() == "my notes\n" and not (out / "checkpoints").exists()


def test_a_fresh_lock_file_is_read_once_and_a_half_written_record_again(tmp_path, monkeypatch):
    """A start reads the record of the lock file it has just made (empty: no holder ever wrote there)
    once, without waiting; a record that does not parse (another host's write caught half done) is
    read again, 50 ms apart, before it counts as none."""
    from core.runtime import ownership

    waits: list[float] = []
    monkeypatch.setattr(ownership.time, "sleep", waits.append)
    monkeypatch.setattr(ownership, "_record", {})
    monkeypatch.setattr(ownership, "_renewing", None)
    ownership.lock_run_folders([tmp_path / "a", tmp_path / "b"])
    ownership.release_run_folders(ended=True)
    assert waits == [] and json.loads((tmp_path / "a" / "plait.lock").read_text())["released"] is True
    half = tmp_path / "half.lock"
    half.write_text('{"pid": 4242, "host": "node-b", "si')
    assert ownership._read_record(half) == {} and waits == [0.05] * (ownership.RECORD_READS - 1)
