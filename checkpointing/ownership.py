"""One writer per run folder, and no rank that outlives its launcher.

:func:`lock_run_folders` takes an exclusive ``flock`` on ``plait.lock`` in the
run's output folder and in its checkpoint folder, wherever that lies.
The kernel drops the lock when the holding process dies, however it dies, so
there is nothing to clean up after a crash. A second job on the same folder
exits with code 2 and names the holder (host, pid, start time, command), which
the lock file records.

:func:`die_with_launcher` makes a rank under torchrun receive SIGKILL when its
parent (torchrun's agent) dies: torchrun starts ranks in sessions of their own,
so without it a ``kill -9`` of the launcher leaves ranks training and writing.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import IO

from core import log
from core.errors import PlaitError

LOCK_FILE = "plait.lock"
_held: list[IO[str]] = []  # open lock files: the locks live as long as these


class FolderInUse(PlaitError):
    """Another live process holds the run folder's lock."""


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        return f"pid {h['pid']} on {h['host']} since {h['since']} ({h['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (no holder recorded)"


def try_lock(folder: Path) -> IO[str] | None:
    """Take ``folder/plait.lock`` without waiting; the open file holds the lock, None if held elsewhere."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    f = open(path, "a+")  # noqa: SIM115  (kept open: the lock lives as long as the file)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    f.seek(0)
    f.truncate()
    f.write(
        json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "command": " ".join(sys.argv)[:300],
            }
        )
        + "\n"
    )
    f.flush()
    return f


def _roots(folders: list) -> list[Path]:
    """The folders to lock, each once. A folder inside another one is locked too: another job may
    name it alone (``checkpoint.dir`` pointing into this run's output folder)."""
    return list(dict.fromkeys(Path(f).resolve() for f in folders))


def lock_run_folders(folders: list) -> None:
    """Own every folder in ``folders`` for the life of this process, or raise FolderInUse."""
    for folder in _roots(folders):
        try:
            f = try_lock(folder)
        except OSError as e:
            raise PlaitError(f"run folder {folder} cannot be created or written: {e.strerror or e}") from None
        if f is None:
            raise FolderInUse(
                f"run folder {folder} is in use by {_holder(folder / LOCK_FILE)}; "
                "one folder has one writer: wait for it, stop it, or choose another train.output_dir"
            )
        _held.append(f)


def hold_run_folders() -> None:
    """Before each save (rank 0): every folder this process locked still holds the lock file it
    locked. A folder deleted, moved aside or replaced while the run trains (``rm -rf``, ``mv out
    out.old``, a cleanup script) has lost it, and the run's next writes re-create the folder unlocked,
    where a job started there meanwhile (or later) writes too. The lock is taken again where the
    folder now is, with one warning; if another job holds it already, raise FolderInUse: this run
    stops, and that job stays the folder's one writer."""
    for name in dict.fromkeys(f.name for f in _held):
        if any(f.name == name and _at_its_path(f) for f in _held):
            continue
        folder = Path(name).parent
        again = try_lock(folder)  # the folder made again if it is gone
        if again is None:
            raise FolderInUse(
                f"run folder {folder} is in use by {_holder(folder / LOCK_FILE)}: it was deleted or replaced while this run "
                "held it, and another job took it; this run stops writing there (one folder has one writer)"
            )
        _held.append(again)  # the old file keeps its lock on what was moved aside, if anything was
        log.warn(f"run folder {folder} was deleted or replaced while this run held it; this run holds it again (its lock made anew)")


def _at_its_path(f: IO[str]) -> bool:
    """Whether the lock file ``f`` is still the file at its path."""
    try:
        return os.path.samestat(os.stat(f.name), os.fstat(f.fileno()))
    except OSError:
        return False


def check_run_folders(folders: list[str | Path]) -> None:
    """What ``core.plan`` asks: would :func:`lock_run_folders` succeed now? Takes nothing."""
    for folder in _roots(folders):
        if not (folder / LOCK_FILE).is_file():
            continue
        f = try_lock(folder)
        if f is None:
            raise FolderInUse(f"run folder {folder} is in use by {_holder(folder / LOCK_FILE)}")
        f.close()


def held_elsewhere(folder: str | Path) -> bool:
    """Whether another live process holds ``folder``'s lock now (this process's own does not count)."""
    import fcntl

    path = Path(folder).resolve() / LOCK_FILE
    if str(path) in {f.name for f in _held}:
        return False
    try:
        with open(path) as f:  # a probe: held only for this instant, and only if nobody else holds it
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no lock file: nobody ever locked it
        return False
    return False


def release_run_folders() -> None:
    while _held:
        _held.pop().close()


def die_with_launcher() -> None:
    """Under torchrun (Linux), ask the kernel for SIGKILL when the launcher that started us dies."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    PR_SET_PDEATHSIG = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
