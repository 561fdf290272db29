"""Test seams, outside plait's code: put this folder on PYTHONPATH to activate them.

The seams that act at a point of a checkpoint save (pause, wait, damage, and the kill points of
``PLAIT_TEST_KILL_AT`` up to ``committed``) are observers of the save's named points
(:mod:`core.checkpoint.checkpointer`); the others replace a function or method by its module path.

``PLAIT_TEST_CLOCK_FILE=PATH`` gives the budget guard the clock in that file.
``PLAIT_TEST_CRASH_AT_STEP=N`` raises in the step that would make step N.
``PLAIT_TEST_PAUSE_BEFORE_COMMIT=STEP:SECONDS`` sleeps before the commit of that
step's checkpoint (its shards and ``.metadata`` are written, ``COMMITTED`` is
not), so a test can kill the job mid-save.
``PLAIT_TEST_KILL_IN_DELETE_AFTER=PATH``: once PATH exists, the process SIGKILLs itself right
after it removes a file other than a ``COMMITTED`` marker or a ``.tmp`` file (a kill mid-pruning).
``PLAIT_TEST_DAMAGE_AFTER_COMMIT=STEP`` flips one byte in the middle of rank 0's shard of that step's
checkpoint once it is committed (damage on disk after the save: bit rot, a bad copy).
``PLAIT_TEST_WAIT_BEFORE_COMMIT=STEP:PATH`` waits before that step's commit until PATH exists.
``PLAIT_TEST_WAIT_BEFORE_LOCK=PATH`` creates ``PATH.ready`` when the preflight is about to take the run
folders' lock, then waits until PATH exists: a job that starts while another one is ending.
``PLAIT_TEST_HANG_DATA_AT_STEP=N``: the data read of training step N never returns (a dead network
mount), on every rank, or only on rank ``PLAIT_TEST_HANG_DATA_ON_RANK`` when that is set.
``PLAIT_TEST_WAIT_BEFORE_STEP=N:PATH[,N:PATH...]``: the data read of training step N creates ``PATH.waiting``, then
waits until PATH exists (every rank): a test acts on the run's folders between two saves.
``PLAIT_TEST_KILL_AT=POINT:STEP:RANK:WHO``: SIGKILL at POINT of the save of step STEP on rank RANK; WHO ``rank``: that
process alone, ``all``: its launcher (torchrun) first, then itself (the others die with their launcher). POINT:
``claimed`` (the step folder and LINEAGE made, rank 0), ``shard`` (in the middle of a shard: after its first block),
``metadata`` (every shard written, before ``.metadata``, rank 0), ``state`` (``state.json`` written, rank 0),
``marker`` (``COMMITTED.tmp`` written and fsynced, before its rename, rank 0), ``committed`` (``COMMITTED`` in
place, before the folder's fsync and pruning, rank 0), ``pruning`` (the first file of an older checkpoint deleted, rank 0).
``PLAIT_TEST_HANG_AT_EXIT=1``: destroying the process groups after the run's end never returns.
``PLAIT_TEST_SLOW_READ_S=SECONDS``: every micro-batch read (training and validation) takes that long.
``PLAIT_TEST_SLOW_WRITE_S=SECONDS``: a save's writes take that long on every rank (a slow file system):
each block written takes 5 ms until they have.
``PLAIT_TEST_BAD_DATA_AT_STEP=N:R``: rank R's first training sample of step N is a bad record.
``PLAIT_TEST_LEASE_S=SECONDS``: the run folder lock's lease (``core.runtime.ownership.LEASE_S``, 10 s).
"""

import os

_pause = os.environ.get("PLAIT_TEST_PAUSE_BEFORE_COMMIT", "")
if _pause:
    import time

    from core.checkpoint import SavePoints, observe

    _step, _seconds = int(_pause.split(":")[0]), float(_pause.split(":")[1])

    class _PauseBeforeCommit(SavePoints):
        def before_commit(self, step, path):
            if step == _step:
                time.sleep(_seconds)

    observe(_PauseBeforeCommit())

# ``PLAIT_TEST_CRASH_AT_STEP=N`` raises inside the training step that would make step N.
_crash = os.environ.get("PLAIT_TEST_CRASH_AT_STEP", "")
if _crash:
    from core.loop.trainer import Trainer

    _train_step = Trainer.train_step

    def _crashing_step(self, *args, **kwargs):
        if self.run.step + 1 == int(_crash):
            raise RuntimeError("planted crash (tests/seams)")
        return _train_step(self, *args, **kwargs)

    Trainer.train_step = _crashing_step

# ``PLAIT_TEST_CLOCK_FILE=PATH``: the budget guard's clock reads the UNIX time written in PATH.
_clock = os.environ.get("PLAIT_TEST_CLOCK_FILE", "")
if _clock:
    from pathlib import Path

    import plugins.monitors.budget_guard as _budget_guard

    _budget_guard.now = lambda: float(Path(_clock).read_text().strip())
    _budget_guard.elapsed = _budget_guard.now  # the monotonic clock follows the same file

# ``PLAIT_TEST_KILL_IN_DELETE_AFTER=PATH``: SIGKILL right after the first file removed once PATH exists.
_kill_after = os.environ.get("PLAIT_TEST_KILL_IN_DELETE_AFTER", "")
if _kill_after:
    import signal

    _unlink = os.unlink

    def _killing_unlink(path, *args, **kwargs):
        _unlink(path, *args, **kwargs)
        name = os.path.basename(os.fsdecode(path))
        if name != "COMMITTED" and not name.endswith(".tmp") and os.path.exists(_kill_after):
            os.kill(os.getpid(), signal.SIGKILL)

    os.unlink = _killing_unlink

# ``PLAIT_TEST_DAMAGE_AFTER_COMMIT=STEP``: one byte flipped in a shard of that checkpoint after its commit.
_damage = os.environ.get("PLAIT_TEST_DAMAGE_AFTER_COMMIT", "")
if _damage:
    from core.checkpoint import SavePoints as _DamagePoints
    from core.checkpoint import observe as _observe_damage

    class _DamageAfterCommit(_DamagePoints):
        def after_commit(self, step, path):
            if step == int(_damage) and os.environ.get("RANK", "0") == "0":
                with open(path / "__0_0.distcp", "r+b") as f:
                    f.seek(f.seek(0, 2) // 2)
                    byte = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([byte[0] ^ 0xFF]))

    _observe_damage(_DamageAfterCommit())


def _wait_for(path):
    import time

    while not os.path.exists(path):
        time.sleep(0.05)


_wait_commit = os.environ.get("PLAIT_TEST_WAIT_BEFORE_COMMIT", "")
if _wait_commit:
    from core.checkpoint import SavePoints as _WaitPoints
    from core.checkpoint import observe as _observe_wait

    _wait_step, _wait_path = _wait_commit.split(":", 1)

    class _WaitBeforeCommit(_WaitPoints):
        def before_commit(self, step, path):
            if step == int(_wait_step):
                _wait_for(_wait_path)

    _observe_wait(_WaitBeforeCommit())

_wait_lock = os.environ.get("PLAIT_TEST_WAIT_BEFORE_LOCK", "")
if _wait_lock:
    from core.runtime import ownership as _ownership

    _lock = _ownership.lock_run_folders

    def _waiting_lock(*args, **kwargs):
        open(_wait_lock + ".ready", "w").close()
        _wait_for(_wait_lock)
        return _lock(*args, **kwargs)

    _ownership.lock_run_folders = _waiting_lock

# ``PLAIT_TEST_HANG_DATA_AT_STEP=N``: the index data sources' check before step N's first micro-batch hangs.
_hang = os.environ.get("PLAIT_TEST_HANG_DATA_AT_STEP", "")
if _hang:
    import time as _time

    from core.data.indexed import IndexedSource

    _check_step = IndexedSource.check_step

    _hang_rank = os.environ.get("PLAIT_TEST_HANG_DATA_ON_RANK", os.environ.get("RANK", "0"))

    def _hanging_check_step(self, first, end):
        if first // (end - first) + 1 == int(_hang) and os.environ.get("RANK", "0") == _hang_rank:
            while True:  # a read on a dead mount
                _time.sleep(3600)
        return _check_step(self, first, end)

    IndexedSource.check_step = _hanging_check_step

# ``PLAIT_TEST_WAIT_BEFORE_STEP=N:PATH[,N:PATH...]``: the data read of step N waits until PATH exists.
_wait_steps = dict(item.split(":", 1) for item in os.environ.get("PLAIT_TEST_WAIT_BEFORE_STEP", "").split(",") if item)
if _wait_steps:
    from core.data.indexed import IndexedSource as _WaitingSource

    _check_step_then = _WaitingSource.check_step

    def _waiting_check_step(self, first, end):
        step = str(first // (end - first) + 1)
        if step in _wait_steps:
            open(_wait_steps[step] + ".waiting", "w").close()
            _wait_for(_wait_steps[step])
        return _check_step_then(self, first, end)

    _WaitingSource.check_step = _waiting_check_step

# ``PLAIT_TEST_KILL_AT=POINT:STEP:RANK:WHO``: SIGKILL at a named point of one save.
_kill_at = os.environ.get("PLAIT_TEST_KILL_AT", "")
if _kill_at:
    import signal as _signal

    from core.checkpoint import SavePoints as _KillPoints
    from core.checkpoint import observe as _observe_kill
    from core.checkpoint import retention as _retention
    from core.checkpoint import safe_dcp as _kill_dcp
    from core.runtime.durable_io import write_durable as _write_durable

    _kill_point, _kill_step, _kill_rank, _kill_who = _kill_at.split(":")
    _in_save = [False]  # in the save of that step: from its own work (after the wait for the save before it) to the next save's

    def _kill_here(point):
        if point != _kill_point or not _in_save[0] or os.environ.get("RANK", "0") != _kill_rank:
            return
        if _kill_who == "all" and "TORCHELASTIC_RUN_ID" in os.environ:
            os.kill(os.getppid(), _signal.SIGKILL)  # torchrun; the other ranks get their PDEATHSIG
        os.kill(os.getpid(), _signal.SIGKILL)

    class _KillAt(_KillPoints):
        def started(self, step):  # a save's first own step, after it waited for the one before
            _in_save[0] = step == int(_kill_step)

        def claimed(self, step, path):
            _kill_here("claimed")

        def state_written(self, step, path):
            _kill_here("state")

        def writing_marker(self, step, path, text):
            if _kill_point == "marker":
                _write_durable(path / "COMMITTED.tmp", text)  # as the marker's own write leaves it, fsynced
            _kill_here("marker")

        def committed(self, step, path):
            _kill_here("committed")

    _observe_kill(_KillAt())
    _stream_write = _kill_dcp._ChecksummingStream.write

    def _killing_write(self, b):
        n = _stream_write(self, b)
        _kill_here("shard")
        return n

    _kill_dcp._ChecksummingStream.write = _killing_write
    _finish = _kill_dcp.HashingFileSystemWriter.finish

    def _killing_finish(self, metadata, results):
        _kill_here("metadata")
        return _finish(self, metadata, results)

    _kill_dcp.HashingFileSystemWriter.finish = _killing_finish
    _remove = _retention.remove

    def _killing_remove(path):
        if _kill_point == "pruning" and _in_save[0] and os.environ.get("RANK", "0") == _kill_rank:
            (path / "COMMITTED").unlink(missing_ok=True)
            first = next((p for p in sorted(path.iterdir()) if p.name.endswith(".distcp")), None)
            if first is not None:
                first.unlink()
            _kill_here("pruning")
        return _remove(path)

    _retention.remove = _killing_remove

# ``PLAIT_TEST_HANG_AT_EXIT=1``: destroying the process groups after the run's end never returns.
if os.environ.get("PLAIT_TEST_HANG_AT_EXIT"):
    import time as _exit_time

    from core.runtime import distributed as _distributed

    def _hanging_shutdown():
        while True:  # a destroy_process_group that waits for a peer that is gone
            _exit_time.sleep(3600)

    _distributed.shutdown = _hanging_shutdown

# ``PLAIT_TEST_SLOW_READ_S=SECONDS``: each micro-batch an index loader reads takes that long.
_slow = os.environ.get("PLAIT_TEST_SLOW_READ_S", "")
if _slow:
    import time as _slow_time

    from core.data.indexed import IndexedLoader

    _indices = IndexedLoader.indices

    def _slow_indices(self, micro):
        _slow_time.sleep(float(_slow))
        return _indices(self, micro)

    IndexedLoader.indices = _slow_indices

# ``PLAIT_TEST_SLOW_WRITE_S=SECONDS``: 5 ms per block written until this save's writes have lasted that long
# (the ranks' shares differ in blocks: a fixed time per block would hold one rank waiting for another).
_slow_write = os.environ.get("PLAIT_TEST_SLOW_WRITE_S", "")
if _slow_write:
    import time as _write_time

    from core.checkpoint import safe_dcp as _safe_dcp

    _write = _safe_dcp._ChecksummingStream.write
    _writes = [0.0, 0.0]  # (first, last) write of the save in hand

    def _slow_block_write(self, b):
        now = _write_time.monotonic()
        if now - _writes[1] > 1.0:  # a new save
            _writes[0] = now
        if now - _writes[0] < float(_slow_write):
            _write_time.sleep(0.005)
        _writes[1] = _write_time.monotonic()
        return _write(self, b)

    _safe_dcp._ChecksummingStream.write = _slow_block_write

# ``PLAIT_TEST_BAD_DATA_AT_STEP=N:R``: on rank R, the first training sample of step N read by the index
# loader is a bad record (DataError), as a corrupt region of a file only that rank reads.
_bad = os.environ.get("PLAIT_TEST_BAD_DATA_AT_STEP", "")
if _bad:
    from core.contract.errors import DataError
    from core.data.indexed import IndexedLoader

    _bad_step, _bad_rank = (int(x) for x in _bad.split(":"))
    _row = IndexedLoader.row

    def _bad_row(self, index):
        if index // self.spec.global_batch + 1 == _bad_step and self.spec.split == "train" and os.environ.get("RANK", "0") == str(_bad_rank):
            raise DataError(f"planted bad record at sample {index} (tests/seams)")
        return _row(self, index)

    IndexedLoader.row = _bad_row


# ``PLAIT_TEST_LEASE_S=SECONDS``: holders renew their lock record that often (a takeover in seconds).
_lease = os.environ.get("PLAIT_TEST_LEASE_S", "")
if _lease:
    from core.runtime import ownership as _ownership

    _ownership.LEASE_S = float(_lease)


# ``PLAIT_TEST_UNREADABLE=PATH[:PATH...]``: each PATH has no read permission for this process, as a folder or
# file of mode 000 on NFS with root squash (the tests run as root, which file modes do not stop): a file there
# cannot be opened; a folder cannot be listed, nor anything in it looked at. PATH itself can be looked at,
# and renamed in its own folder, but not moved to another (Linux updates a moved folder's "..", which
# takes write permission on it: rename(2), EACCES).
_unreadable = os.environ.get("PLAIT_TEST_UNREADABLE", "")
if _unreadable:
    import builtins as _builtins
    import errno as _errno
    import io as _io

    _real_lstat = os.lstat

    def _identity(path):
        try:
            st = _real_lstat(path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    # what is at PATH now: a folder made there after this one was renamed away is readable
    _denied = {os.path.abspath(p): _identity(p) for p in _unreadable.split(":") if p}

    def _deny(path, whole):
        try:
            here = os.path.abspath(os.fspath(path))
        except TypeError:  # a file descriptor
            return
        for d, ident in _denied.items():
            if (here.startswith(d + os.sep) or (whole and here == d)) and (ident is None or _identity(d) == ident):
                raise PermissionError(_errno.EACCES, "Permission denied", here)

    def _checked(real, whole):
        def call(path=".", *args, **kwargs):
            _deny(path, whole)
            return real(path, *args, **kwargs)

        return call

    os.stat = _checked(os.stat, False)
    os.lstat = _checked(os.lstat, False)
    os.open = _checked(os.open, True)
    os.scandir = _checked(os.scandir, True)
    os.listdir = _checked(os.listdir, True)
    _builtins.open = _io.open = _checked(_io.open, True)

    def _moving(real):
        def call(src, dst, *args, **kwargs):
            here, there = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
            denied = here in _denied and _denied[here] in (None, _identity(here))
            if denied and os.path.isdir(here) and os.path.dirname(here) != os.path.dirname(there):
                raise PermissionError(_errno.EACCES, "Permission denied", here, None, there)
            _deny(src, False)
            return real(src, dst, *args, **kwargs)

        return call

    os.rename = _moving(os.rename)
    os.replace = _moving(os.replace)
