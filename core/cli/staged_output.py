"""A command's output (``core.export``, ``core.report``) written whole or not at all.

Every file goes first into a staging folder inside ``--out`` (``.plait-<command>-<pid>.partial``) and
is moved into ``--out`` only once all of them are written. A write that fails (a full disk, a quota,
an I/O error; safetensors reports it as its own error) is one line naming ``--out`` and the error,
exit code 74 (as a checkpoint that could not be written), no traceback; what the command wrote is
removed with the staging folder, the folders it made for ``--out`` too, and whatever ``--out`` held
before (an earlier export of the same name) is left as it was: never a ``config.json`` without its
weights, nor curves without ``manifest.json``.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from core.checkpoint import EXIT_SAVE_FAILED, io_error


def write_error(e: BaseException) -> str | None:
    """``CODE: text`` of a failed write (an OSError, torch's or safetensors' report of one); None otherwise."""
    found = io_error(e)
    if isinstance(found, OSError):
        return f"{errno.errorcode.get(found.errno or 0, type(found).__name__)}: {found.strerror or found}"
    if found is not None:
        return str(found).splitlines()[0]
    text = str(e)
    if type(e).__name__ == "SafetensorError" and "I/O error" in text:
        code = re.search(r"os error (\d+)", text)
        what = re.sub(r"\s*\(os error \d+\)", "", text.split("I/O error: ")[-1])
        return f"{errno.errorcode.get(int(code.group(1)), 'EIO') if code else 'EIO'}: {what}"
    return None


@contextmanager
def staged(out: Path, command: str) -> Iterator[Path]:
    """A folder to write ``command``'s files into; they are moved into ``out`` when the block ends
    without an error. A write error ends the process (exit code 74) after removing what was written."""
    made = [p for p in [out, *out.parents] if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    stage = out / f".plait-{command}-{os.getpid()}.partial"
    try:
        stage.mkdir()
        yield stage
        for path in sorted(stage.iterdir()):
            os.replace(path, out / path.name)
        stage.rmdir()
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        for folder in made:  # innermost first: only the folders this command made, and only if empty
            try:
                folder.rmdir()
            except OSError:
                break
        why = write_error(e)
        if why is None:
            raise
        print(
            f"plait: error: cannot write {out} ({why}; disk full, read-only or failing?): nothing was written there, what it held is unchanged",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EXIT_SAVE_FAILED) from None
