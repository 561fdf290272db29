"""A collective that failed because another rank is gone: one line that says so, on the rank that saw it.

When a node is lost (its machine stopped, its agent and ranks killed), the ranks left wait for it
in their next collective, which fails: at once when the kernel closes its connections ("Connection
closed by peer", "Connection reset by peer"), or after ``train.collective_timeout_s`` when nothing
answers. Either way each survivor died of a gloo (or NCCL) traceback, and when the lost node held
rank 0, which writes ``exit_status.json``, that traceback was all there was. :func:`explain` turns
such an error into :class:`PeerLost`, whose one line names this rank, what it was doing (the stall
watchdog's phase), what the transport said, and the last complete checkpoint a restart resumes
from; ``core/cli/train.py`` prints it on every rank that sees it, and rank 0 records it in
``exit_status.json`` (reason ``error``: launchers restart it). Any other error is left alone.
"""

from __future__ import annotations

import re
from pathlib import Path

# What gloo (and the store) say when the other end of a connection is gone or never answered.
_PEER = r"(?: ?\[[^\]]*\](?::\d+)?)?"  # the other end's address, as gloo writes it: [127.0.0.1]:17120
_GONE = re.compile(rf"(Connection (?:closed|reset) by peer{_PEER}|Socket closed{_PEER}|Broken pipe|Connection refused{_PEER})", re.IGNORECASE)
_TIMED_OUT = re.compile(rf"(Timed out waiting \d+ms for \w+ operation(?: to complete)?|Connect timeout{_PEER}|Watchdog caught collective operation timeout)")


class PeerLost(RuntimeError):
    """A collective failed because another rank is gone or did not answer: the run ends, for a restart."""


def _texts(error: BaseException, depth: int = 0) -> list[str]:
    """The messages of ``error``, the errors it carries (DCP's ``failures``) and its causes."""
    if depth > 4:
        return []
    found = [str(error)]
    for failure in (getattr(error, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            found += _texts(inner, depth + 1)
    cause = error.__cause__ or error.__context__
    if cause is not None:
        found += _texts(cause, depth + 1)
    return found


def restart_from(checkpoint_root: Path) -> str:
    """Where a restart resumes: the newest committed checkpoint in the folder, as it is now."""
    from core.checkpoint import committed

    try:
        done = committed(checkpoint_root)
    except OSError as e:
        return f"the last complete checkpoint (its folder could not be read: {e.strerror or e})"
    return f"the last complete checkpoint, {done[-1]}" if done else f"the start (no complete checkpoint in {checkpoint_root} yet)"


def explain(error: BaseException, rank: int, doing: str, checkpoint_root: Path, collective_timeout_s: float) -> PeerLost | None:
    """:class:`PeerLost` for an ``error`` that says another rank is gone or timed out; None otherwise."""
    if isinstance(error, PeerLost):
        return error
    texts = _texts(error)
    gone = next((m.group(1).strip() for t in texts if (m := _GONE.search(t))), None)
    timed_out = next((m.group(1).strip() for t in texts if (m := _TIMED_OUT.search(t))), None)
    if gone is not None:
        what = f"another rank is gone ({gone}) while this one was {doing}: a node, or a process of it, was lost"
    elif timed_out is not None:
        what = (
            f"another rank did not answer within train.collective_timeout_s = {collective_timeout_s:g} s ({timed_out}) "
            f"while this one was {doing}: a node, or a process of it, is lost or hung"
        )
    else:
        return None
    return PeerLost(f"rank {rank}: {what}; this rank ends too, and a launcher restarts the run from {restart_from(checkpoint_root)}")
