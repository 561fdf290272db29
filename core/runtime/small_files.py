"""Reading the small files of checkpoint and run folders (JSON and one-line text) as untrusted input.

``state.json``, ``COMMITTED``, ``LINEAGE``, ``rng/*.json``, ``CURRENT_RUN``, ``BEST.json``,
``SETTING_ASIDE.json`` and ``exit_status.json`` are read before anything vouches for them (the
manifest's checksums are in one of them). Damage or a crafted file must end as one line and a
fallback, never a hang or a traceback, so every read here:

* opens without blocking and reads only a regular file: a FIFO in place of ``state.json`` (or a
  symbolic link to one, or to ``/dev/zero``) would otherwise block the start, or read without end,
  before the stall watchdog exists (``IsADirectoryError`` for a folder, ``OSError`` for the rest);
* reads at most :data:`MAX_BYTES` (a save writes a few kilobytes);
* turns what :func:`json.loads` raises besides ``ValueError`` (``RecursionError`` for a deeply
  nested value) into a ``ValueError``; invalid UTF-8 is a ``ValueError`` (``UnicodeDecodeError``) too.

So a caller catches ``(OSError, ValueError)``, as it would for an unreadable or unparsable file.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_BYTES = 64 * 2**20


def read_bytes(path: Path, limit: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", str(path))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "is not a regular file (a pipe, a device or a socket)", str(path))
        if os.fstat(fd).st_size > limit:  # refused before reading (a sparse file of terabytes reads as zeros)
            raise OSError(errno.EFBIG, f"is larger than {limit} bytes", str(path))
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"is larger than {limit} bytes, more than a save ever writes there", str(path))
    return data


def read_text(path: Path) -> str:
    """The UTF-8 text of ``path``. Raises OSError, or ValueError for text that is not UTF-8."""
    return read_bytes(path).decode()


def read_json(path: Path) -> Any:
    """The JSON value in ``path``. Raises OSError, or ValueError for anything that is not JSON."""
    text = read_text(path)
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to be JSON a save writes") from None
