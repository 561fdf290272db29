"""Every rank must write into the same checkpoint folder: one folder that every node sees.

A DCP save writes each rank's shards into the checkpoint folder, and rank 0 alone commits it, so a
``checkpoint.dir`` that is a disk of each node's own (a local path where a shared file system was
meant) would leave every checkpoint in pieces. :func:`check_shared` finds it when the process group
starts, before any checkpoint is read or written: rank 0 writes a file with a random name into its
folder, and every rank looks for it in its own; a rank that does not see it ends the run with one
line from rank 0 (exit code 2), and removes the folders its start made there if they are empty
(never a lock file another process wrote). ``core.plan`` runs on one node and cannot see the
others: it only names the folder that must be shared. Test: ``tests/faults/test_nodes.py``.
"""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path
from typing import Any

PROBE_PREFIX = ".plait-shared-probe-"
SEEN_WITHIN_S = 2.0  # a network file system may show another host's new file a moment late


def sees(path: Path, token: str, within_s: float = SEEN_WITHIN_S) -> bool:
    """Whether ``path`` holds ``token``, looking again for up to ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if path.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def check_shared(where: Any, what: str) -> None:
    """End the run (exit code 2; one line from rank 0) unless every rank sees the file rank 0 wrote
    into its checkpoint folder. ``where``: a :class:`core.checkpoint.checkpoint_dir.CheckpointDir`
    (its root, its ranks, its gloo group); ``what``: how the config names the folder."""
    from core.checkpoint.resume import stop_every_rank
    from core.runtime.distributed import agree
    from core.runtime.durable_io import write_durable

    root, dist = Path(where.root), where.dist
    probe: Any = None
    if dist.is_main:
        name, token = f"{PROBE_PREFIX}{uuid.uuid4().hex}", f"{socket.gethostname()} {uuid.uuid4().hex}"
        try:
            write_durable(root / name, token)
            probe = (name, token)
        except OSError as e:
            probe = f"{type(e).__name__}: {e}"
    probe = agree(probe, "root", where.group)
    if isinstance(probe, str):  # rank 0 could not write there: the first save would say so, rank by rank
        return
    name, token = probe
    mine = (sees(root / name, token), socket.gethostname(), str(root))
    everyone: list[Any] = agree(mine, "all", where.group)
    if dist.is_main:
        (root / name).unlink(missing_ok=True)
    blind = [(r, host, folder) for r, (seen, host, folder) in enumerate(everyone) if not seen]
    if not blind:
        return
    if not mine[0]:  # the folders this rank's start made on its own disk stay only if something is in them
        from core.runtime.made_folders import remove_what_this_start_made

        remove_what_this_start_made()
    host0 = everyone[0][1]
    named = ", ".join(f"rank {r} on {host}" + (f" (its folder: {folder})" if folder != str(root) else "") for r, host, folder in blind[:4])
    more = f" and {len(blind) - 4} more" if len(blind) > 4 else ""
    stop_every_rank(
        where,
        f"{what} = {root}: {named}{more} cannot see the file that rank 0 on {host0} wrote there; every node must "
        f"write its shards into the same checkpoint folder (a shared file system, a ReadWriteMany volume), not a disk "
        f"of its own: set checkpoint.dir to a folder that every node mounts",
    )
