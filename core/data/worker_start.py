"""How loader worker processes start: from a fork server, never forked from the rank itself.

A rank is multi-threaded (the stall watchdog, the peer view, TensorBoard's writer, async saves'
threads, gloo's). ``fork()`` copies only the calling thread, with every lock as it was: a lock
another thread held at that moment stays held in the child for ever. CPython releases
without the fix for gh-112275 (3.11.7 among them) have one such lock in the fork itself (the
interpreter's thread-list lock, re-initialised too late), and a worker forked while another thread
held it hangs before running a line: the rank then waits for its batch until the stall watchdog ends
the run (``bench/soak.py`` hit it once, after about 250 rollbacks of two ranks with two workers each).

So workers start from multiprocessing's ``forkserver``: one single-threaded process per rank,
started once, which forks each worker. It imports ``torch`` and the data module ahead
(``set_forkserver_preload``), so a worker starts as fast as a forked one after the first (about
2 s once per rank). It is started with SIGINT, SIGTERM and SIGHUP blocked, a mask it and its
workers keep: a Ctrl-C, a SIGTERM to the job's process group (SLURM) or a closed terminal's SIGHUP
must not end it, or its workers would see their parent gone and exit, and the rank crash instead
of stopping at the step boundary with a checkpoint (workers also ignore them:
:func:`core.data.indexed.ignore_stop_signals`). It exits when its rank does (the end of a pipe
from the rank, which workers let go of: :func:`let_go_of_server`), and its workers then see their
parent gone and exit.

A worker re-imports the main module as ``__mp_main__``, as under ``spawn``: a script that builds
loaders with workers needs the ``if __name__ == "__main__":`` guard (``python -m core.train`` has it).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from typing import Any

from core.contract.errors import DataError

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
_lock = threading.Lock()


def worker_context(*modules: str) -> Any:
    """The multiprocessing context for a DataLoader's ``multiprocessing_context``: the fork server,
    started now (if it is not running) with ``modules`` imported ahead and the stop signals blocked."""
    from multiprocessing import forkserver, resource_tracker

    ctx = multiprocessing.get_context("forkserver")
    with _lock:
        ctx.set_forkserver_preload(["torch", *modules])  # only read when the server starts
        before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # the processes started now inherit the mask
        try:
            resource_tracker.ensure_running()  # the server's helper (it ignores SIGINT, SIGTERM), which unblocks those two when started
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            _socket_folder()
            forkserver.ensure_running()
        except OSError as e:  # no temporary folder it can write (full, read-only, none): one line, never a traceback restarted
            raise DataError(
                f"data loader workers cannot start: their fork server's socket in a temporary folder (TMPDIR={os.environ.get('TMPDIR', 'unset')}) "
                f"failed ({type(e).__name__}: {e}); "
                "set TMPDIR to a short folder this user can write, or data.workers = 0"
            ) from None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)  # a signal that came meanwhile is delivered now
    return ctx


SOCKET_PATH_MAX = 107  # a Unix socket's path (Linux: 108 bytes with its NUL)


def _socket_folder() -> None:
    """The folder the fork server's socket goes in (``<tmp>/pymp-XXXXXXXX/listener-XXXXXXXX``, 32
    characters more than ``TMPDIR``): under a ``TMPDIR`` too long for a socket's path (a scheduler's
    job folder deep in a scratch file system) Python 3.11 failed with ``AF_UNIX path too long``, so
    the first of /tmp, /var/tmp and /dev/shm that is short and writable is used instead (as Python 3.13
    does). Made once per process; multiprocessing removes it at exit."""
    import tempfile
    from multiprocessing import util

    if len(tempfile.gettempdir()) + 32 <= SOCKET_PATH_MAX:
        return
    for short in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(short) and os.access(short, os.W_OK | os.X_OK):
            saved, tempfile.tempdir = tempfile.tempdir, short
            try:
                util.get_temp_dir()  # made now in `short`, kept for the process (a folder made before is kept as it was)
            finally:
                tempfile.tempdir = saved
            return


def let_go_of_server() -> None:
    """In a worker: close its copy of the fork server's keep-alive pipe. The server hands one to each
    process it starts, and ends only when every copy is closed: kept, a rank killed without ending
    its workers (SIGKILL, the OOM killer) would leave the server and its workers behind for good,
    each waiting for the other. Let go of, the server ends with its rank, and the workers, their
    parent gone, within seconds (torch's worker loop watches its parent)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # multiprocessing's own (private) state: the only handle on that pipe
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        setattr(server, "_forkserver_alive_fd", None)
        try:
            os.close(fd)
        except OSError:
            pass


def end_workers() -> None:
    """At the rank's end, before multiprocessing's temporary folder is removed: the fork server's
    workers still running are killed (they only read data; they ignore the stop signals) and waited
    for, up to 2 s. A loader dropped without ending its workers (the iterator ``state_dict()`` starts)
    left them to end seconds after the rank, with the fork server, and each one's exit then failed to
    remove its socket from the folder the rank had removed: a traceback each on a clean run's stderr."""
    import time

    pid = server_pid()
    try:
        workers = [int(k) for k in open(f"/proc/{pid}/task/{pid}/children").read().split()] if pid else []
    except OSError:  # the server gone, or no /proc
        return
    for worker in workers:
        try:
            os.kill(worker, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and any(_running(w) for w in workers):
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def server_pid() -> int | None:
    """The running fork server's process id (tests)."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)
