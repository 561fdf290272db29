"""One writer per run folder, and no rank that outlives its launcher.

:func:`lock_run_folders` takes an exclusive ``flock`` on ``plait.lock`` in the
run's output folder and in its checkpoint folder, wherever that lies.
The kernel drops the lock when the holding process dies, however it dies, so
there is nothing to clean up after a crash. A second job on the same folder
exits with code 2 and names the holder (host, pid, start time, command), which
the lock file records.

Some file systems do not share ``flock`` between hosts (NFS mounted with ``nolock``, most FUSE
mounts of object stores): there a job on another host takes the lock as if it were free. So the
holder also renews its record in the lock file every ``LEASE_S`` seconds (a thread; the record
counts its renewals) and marks it released at a clean end. A job that takes the lock over a record
from another host that was never released watches it for two lease periods first: if it is
renewed, its holder is alive, and the job stops as for a held lock (exit 2). A restart on the same
host, or after a clean end, does not wait. The waits count renewals on this host's monotonic clock,
never the hosts' wall clocks (which may differ).

A holder stopped longer than that (SIGSTOP, a paused VM, a stall on a network mount) wakes up to
another job's record: it is fenced (:func:`fence`). Before each renewal, each save (rank 0,
:func:`hold_run_folders`) and each commit it reads the record, and when another pid or host wrote it,
the process ends at once with exit code 2 and one line naming that job, writing nothing more there
(no record, no checkpoint, no ``exit_status.json``); the other ranks end with their launcher.

The lock file itself must be a plain file: a symbolic link there (to a user's file, to another run's
lock) is refused, never followed and overwritten.

:func:`die_with_launcher` makes a rank under torchrun receive SIGKILL when its
parent (torchrun's agent) dies: torchrun starts ranks in sessions of their own,
so without it a ``kill -9`` of the launcher leaves ranks training and writing.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import IO

from core.contract import log
from core.contract.errors import EXIT_BAD_INPUT, PlaitError

LOCK_FILE = "plait.lock"
LEASE_S = 10.0  # how often a holder renews its record in the lock file
RECORD_READS = 5  # a record that does not parse is read this many times (50 ms apart) before it counts as none
_held: list[IO[str]] = []  # open lock files: the locks live as long as these
_record: dict = {}  # this process's record in them
_renewing: threading.Event | None = None  # set: the renewing thread stops
_renewer: threading.Thread | None = None  # that thread, joined at a clean end
taken: list[str] = []  # why this process lost a run folder to another job: it writes nothing more there


class FolderInUse(PlaitError):
    """Another live process holds the run folder's lock."""


def _holder(path: Path) -> str:
    h = _read_record(path)
    if not h:
        return "another process (no holder recorded)"
    return f"pid {h['pid']} on {h['host']} since {str(h.get('since'))[:40]} ({str(h.get('command'))[:300]})"


def _read_record(path: Path) -> dict:
    """The lock file's record, read through a fresh open (another host's writes show then); {} if none,
    or if what is there names no holder (a tool's bytes: a FIFO, a value nested without end, a JSON
    object without pid and host are read as untrusted, :mod:`core.runtime.small_files`, never a hang,
    an exception or a fence). A record that does not parse is read again a few times first: a reader on
    another host may catch a write of it half done (a record taken for none would let a start take a
    live holder's folder). An empty file is read once: no holder ever wrote there (:func:`_write` never
    leaves the file empty), as for the lock file a start has just made."""
    from core.runtime import small_files

    for attempt in range(RECORD_READS):
        try:
            record = small_files.read_json(path)
        except OSError:
            return {}
        except ValueError:
            if _empty(path):
                return {}
            if attempt + 1 < RECORD_READS:
                time.sleep(0.05)
            continue
        holder = isinstance(record, dict) and isinstance(record.get("pid"), int) and isinstance(record.get("host"), str) and len(record["host"]) < 256
        return record if holder else {}
    return {}


def _empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except OSError:
        return True


def _write(f: IO[str], record: dict) -> None:
    """Write ``record`` over the one before in one write, padded with spaces (JSON allows them) to the
    file's length, so that no end of a longer record is left after it: a reader never finds the file
    empty or half written (a rewrite never shrinks the file)."""
    text = json.dumps(record)
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    f.write(text.ljust(size - 1) + "\n")
    f.flush()
    os.fsync(f.fileno())  # seen by the other hosts of a network file system


def _unreleased_elsewhere(record: dict) -> bool:
    """Whether ``record`` is another host's holder's, renewed and never released: it may be alive."""
    return bool(record) and not record.get("released") and not _this_kernel(record) and "renewals" in record


def _boot_id() -> str:
    """This kernel's boot id (Linux): hosts that share a name (containers given the same hostname on
    two machines) are told apart by it; '' where there is none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _this_kernel(record: dict) -> bool:
    """Whether ``record`` was written on this host's running kernel, whose flock this process shares:
    the same host name, and the same boot id where both have one."""
    boot = record.get("boot")
    return record.get("host") == socket.gethostname() and (not boot or not _boot_id() or boot == _boot_id())


def watch_s(record: dict) -> float:
    """How long a start watches ``record`` for a renewal: two of its lease periods and a second
    (a lease that is not a finite number counts as LEASE_S; one above 60 s as 60 s)."""
    lease = record.get("lease_s")
    lease = float(lease) if isinstance(lease, (int, float)) and not isinstance(lease, bool) and math.isfinite(lease) else LEASE_S
    return 2 * min(max(lease, 0.1), 60.0) + 1


def alive_elsewhere(path: Path, previous: dict) -> bool:
    """Whether the holder of ``previous`` (another host's record, never released) renews it within
    two of its lease periods: then it is alive, and its host does not share this lock."""
    if not _unreleased_elsewhere(previous):
        return False
    wait = watch_s(previous)
    log.info(
        f"run folder {path.parent}: its last holder, pid {previous.get('pid')} on {previous.get('host')}, did not release it; "
        f"waiting {wait:.0f} s to see that it is gone (not every file system shares the lock between hosts)"
    )
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        time.sleep(min(0.5, wait / 4))
        now = _read_record(path)
        if now != previous and now.get("pid") == previous.get("pid") and now.get("host") == previous.get("host"):
            return not now.get("released")
    return False


def try_lock(folder: Path, claim: bool = True) -> IO[str] | None:
    """Take ``folder/plait.lock`` without waiting (module docstring: a holder on another host is
    watched for first); the open file holds the lock, None if held elsewhere. ``claim=False``: a
    look only (``core.plan``), which neither watches nor writes the record."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    if why := lock_file_problem(path):
        raise PlaitError(why)
    f = open(path, "r+", opener=_no_link)  # noqa: SIM115  (kept open: the lock lives as long as the file; not appending: _write)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    if not claim:
        return f
    if alive_elsewhere(path, _read_record(path)):
        f.close()
        return None
    if not _record:
        _record.update(
            pid=os.getpid(),
            host=socket.gethostname(),
            boot=_boot_id(),
            since=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            command=" ".join(sys.argv)[:300],
            lease_s=LEASE_S,
            renewals=0,
        )
    _write(f, _record)
    return f


def _no_link(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, 0o666)  # a link put there since lock_file_problem looked: ELOOP


def lock_file_problem(path: Path) -> str:
    """Why ``path`` cannot be a run folder's lock file ('' if it can): plait writes its record
    there, so a symbolic link (to a user's file, to another run's lock) is never followed."""
    if path.is_symlink():
        return f"run folder {path.parent}: {path.name} is a symbolic link (to {os.readlink(path)}); expected a plain file plait writes its lock record in: remove the link"
    if path.exists() and not path.is_file():
        return f"run folder {path.parent}: {path.name} is not a plain file; expected the file plait writes its lock record in: remove it"
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        return f"run folder {path.parent}: {path.name} cannot be read and written by this user; expected the file plait writes its lock record in"
    return ""


def _renew(stop: threading.Event) -> None:
    """Renew this process's record in every lock file it holds, every ``LEASE_S`` (a daemon thread)."""
    while not stop.wait(LEASE_S):
        _record["renewals"] = int(_record.get("renewals", 0)) + 1
        for f in list(_held):
            try:
                _fence(f)  # never over another job's record: this process was frozen past its lease
                _write(f, _record)
            except (OSError, ValueError):  # a full disk, a closed file: the flock still holds here
                pass


def _taken_by(f: IO[str]) -> str:
    """'' while the lock file ``f`` holds this process's record (or none, or it is no longer at its
    path: :func:`hold_run_folders`' business); else the line that names the job that took it."""
    if not _record or f.closed or not _at_its_path(f):
        return ""
    record = _read_record(Path(f.name))
    if not record or all(record.get(k) == _record.get(k) for k in ("pid", "host", "boot")):
        return ""
    return (
        f"run folder {Path(f.name).parent} is in use by pid {record.get('pid')} on {record.get('host')} (since {str(record.get('since'))[:40]}, "
        f"{str(record.get('command'))[:300]}), which took it over while this run held it: this process was stopped or cut off longer "
        f"than its lease ({2 * LEASE_S + 1:.0f} s) and the lock is not shared between the hosts; this run stops and writes "
        "nothing more there (one folder has one writer)"
    )


def _fence(f: IO[str]) -> None:
    """End this process at once (exit code 2, one line) if another job took ``f``'s folder: nothing
    of it (its record, a checkpoint in flight, exit_status.json) is written there any more."""
    line = _taken_by(f)
    if not line:
        return
    taken.append(line)
    log.error(line, all_ranks=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_BAD_INPUT)


def fence() -> None:
    """Before a checkpoint's commit (rank 0): end this process (exit code 2, one line) if another
    job took one of its run folders while it was stopped (module docstring)."""
    for f in list(_held):
        _fence(f)


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
    global _renewing, _renewer
    if _held and _renewing is None:
        _renewing = threading.Event()
        _renewer = threading.Thread(target=_renew, args=(_renewing,), name="plait-lock-lease", daemon=True)
        _renewer.start()


def hold_run_folders() -> None:
    """Before each save (rank 0): every folder this process locked still holds the lock file it
    locked. A folder deleted, moved aside or replaced while the run trains (``rm -rf``, ``mv out
    out.old``, a cleanup script) has lost it, and the run's next writes re-create the folder unlocked,
    where a job started there meanwhile (or later) writes too. The lock is taken again where the
    folder now is, with one warning; if another job holds it already, raise FolderInUse: this run
    stops, and that job stays the folder's one writer. A folder taken over while this process was
    stopped past its lease ends it at once (:func:`fence`)."""
    fence()
    for name in dict.fromkeys(f.name for f in _held):
        if any(f.name == name and _at_its_path(f) for f in _held):
            continue
        folder = Path(name).parent
        try:
            again = try_lock(folder)  # the folder made again if it is gone
        except PlaitError as e:  # a link or a folder put where its lock file was: every rank stops (exit 2)
            raise FolderInUse(str(e)) from None
        if again is None:
            taken.append(str(folder))
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
    """What ``core.plan`` asks: would :func:`lock_run_folders` succeed now? Takes nothing, waits for
    nothing: another host's record, never released, is one warning (a start would watch it)."""
    for folder in _roots(folders):
        path = folder / LOCK_FILE
        if why := lock_file_problem(path):
            raise PlaitError(why)
        if not path.is_file():
            continue
        try:
            f = try_lock(folder, claim=False)
        except OSError as e:
            raise PlaitError(f"run folder {folder}: {LOCK_FILE} cannot be opened ({e.strerror or e}); expected a file plait can lock") from None
        if f is None:
            raise FolderInUse(f"run folder {folder} is in use by {_holder(path)}")
        f.close()
        record = _read_record(path)
        if _unreleased_elsewhere(record):
            try:
                age = f"{max(0.0, time.time() - path.stat().st_mtime):.0f} s ago"  # for the reader only: the hosts' clocks may differ
            except OSError:
                age = "lately"
            log.warn(
                f"run folder {folder} looks held by pid {record.get('pid')} on host {record.get('host')} (its record in {LOCK_FILE} renewed "
                f"{age}, never released; this host cannot see that lock): a start waits {watch_s(record):.0f} s to see "
                "whether it is still renewed, and stops (exit 2) if it is",
                once=f"held by {record.get('pid')} on {record.get('host')}",
            )


def held_here(folder: str | Path) -> bool:
    """Whether this process holds ``folder``'s lock (it wrote the lock file there)."""
    return str(Path(folder).resolve() / LOCK_FILE) in {f.name for f in _held}


def held_elsewhere(folder: str | Path) -> bool:
    """Whether another live process holds ``folder``'s lock now (this process's own does not count)."""
    import fcntl

    path = Path(folder).resolve() / LOCK_FILE
    if held_here(folder):
        return False
    try:
        with open(path) as f:  # a probe: held only for this instant, and only if nobody else holds it
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no lock file: nobody ever locked it
        return False
    return False


def release_run_folders(ended: bool = False) -> None:
    """Close this process's lock files (the kernel drops the locks). ``ended``: the holder's clean
    end, marked in its record first, so that a job on another host need not watch it; never in a
    forked loader worker, whose copies of the files close while the rank holds on."""
    global _renewing, _renewer
    if _renewing is not None and ended:
        _renewing.set()
        _renewing = None
        if _renewer is not None and _renewer is not threading.current_thread():
            _renewer.join(timeout=5)  # gone when this returns (a renewal under way writes one small file)
        _renewer = None
    while _held:
        f = _held.pop()
        if ended and not _taken_by(f):  # another job's record is never overwritten
            try:
                _write(f, {**_record, "released": True})
            except (OSError, ValueError):
                pass
        f.close()


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
