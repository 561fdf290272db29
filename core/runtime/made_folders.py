"""Folders a process creates for a run, and their removal when the start that made them fails.

:func:`probe_folder` makes a folder (with missing parents) and proves it writable; the folders a
training start made and kept are recorded in :data:`made_by_this_start`, so that a refusal found
later, once the process group exists (:mod:`core.checkpoint.resume`), removes them again
(:func:`remove_what_this_start_made`), each only if it is still empty. Nothing else is touched.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from core.contract.errors import ConfigError
from core.runtime.ownership import LOCK_FILE, held_here, release_run_folders


def probe_folder(folder: Path, what: str, keep: bool = True) -> list[Path]:
    """Create ``folder`` (with missing parents) and write and delete a file in it, so that a folder
    that cannot be written fails now, not at the first save. Removes the probe file, and with
    ``keep=False`` the folders it created itself; nothing else is touched. Returns the folders it
    created and kept, outermost first."""
    missing = []
    p = folder
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    if not p.is_dir():
        raise ConfigError(f"{what} = {folder}: {p} is a file, expected a folder")
    created: list[Path] = []
    probe = folder / f".plait-write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        for d in reversed(missing):
            try:
                d.mkdir()
                created.append(d)
            except FileExistsError:  # another rank made it
                pass
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"plait")
        finally:
            os.close(fd)
            os.unlink(probe)  # also when the write failed (a full disk lets the empty file be made)
    except OSError as e:
        remove_created(created)
        raise ConfigError(
            f"{what} = {folder}: cannot create or write a file there ({type(e).__name__}: {e.strerror or e}); expected a writable folder"
        ) from None
    if not keep:
        remove_created(created)
        return []
    return created


def remove_created(created: list[Path]) -> None:
    """Remove folders this start created (outermost first in ``created``), innermost first, each
    only if it is empty but for the lock file this process wrote there; anything else stays (a
    lock file that another process wrote into a folder this one made, among them)."""
    if not created:
        return
    ours = {d for d in created if held_here(d)}
    release_run_folders(ended=True)  # the start failed: this process writes nothing there
    for d in reversed(created):
        try:
            if d in ours:
                (d / LOCK_FILE).unlink(missing_ok=True)
            d.rmdir()
        except OSError:  # not empty (another rank's probe, a user's file), or gone
            pass


# The folders this process's start created (kept): a refusal found later, once the process group
# exists (core.checkpoint.resume), removes them again on the ranks it ends.
made_by_this_start: list[Path] = []


def remove_what_this_start_made() -> None:
    """Remove the folders this process's start created, each only if it is still empty."""
    remove_created(made_by_this_start)
    made_by_this_start.clear()
