"""Writes that survive a machine crash, not only a killed process.

A killed process loses nothing the kernel already holds; a power loss, a kernel panic or a
cloud VM stopped hard loses whatever the page cache had not written out, and a rename can
reach the disk before the data of the file it names. A checkpoint's ``COMMITTED`` marker must
therefore reach the disk after every file it lists, and older checkpoints are pruned only
after the marker itself is on disk. DCP fsyncs the shards and ``.metadata`` it writes
(``FileSystemWriter(sync_files=True)``, its default); plait's own files go through here:

* :func:`write_durable` writes a file and fsyncs it;
* :func:`sync_dir` fsyncs a folder, so that the names created, renamed or removed in it persist;
* :func:`replace_durable` is write-to-temporary, fsync, ``os.replace``, fsync of the folder;
* :class:`Checksum` is the running CRC-32 a checkpoint's files are written and checked with.

A file system that cannot fsync a folder (``EINVAL``, ``ENOTSUP``: some network and FUSE file
systems) makes :func:`sync_dir` a no-op; any other error is raised, as a failed write would be.
"""

from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path
from typing import Any

from core.runtime import watchdog

_NO_DIR_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EISDIR, errno.EACCES}


def write_durable(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it before returning."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def sync_dir(path: Path) -> None:
    """fsync the folder ``path`` (its entries: files created, renamed or removed in it)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        if e.errno in _NO_DIR_SYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIR_SYNC:
            raise
    finally:
        os.close(fd)


def replace_durable(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably: a reader (or a crash) sees the old
    file or the new one, never a mix, and once this returns the new one is on disk. A write that
    fails (a full disk) leaves the old file and no partial copy beside it."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write_durable(tmp, text)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    sync_dir(path.parent)


class Checksum:
    """A running CRC-32, fed while a file is written or read."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)
        watchdog.alive()  # a block written or checked: a long save or resume check that moves is no stall

    def hexdigest(self) -> str:
        return f"{self.value:08x}"
