"""Every rank's phase, in the job's rendezvous store: who holds the others up.

Each rank sees only its own progress; when one rank hangs, the others wait for it in a
collective and each would say only what it was doing itself. So each rank's watchdog publishes its
phase (:meth:`core.runtime.marks.Marks.record`: what, where in the loop, since when, last moved; wall
times, as monotonic clocks differ between hosts) into the store torchrun's rendezvous serves, and
a rank that stalls reads every rank's record, names the rank furthest behind, and tells the others
that it ends the run (:meth:`PeerView.end`), so that they say where they are before its exit
breaks their collectives.

The store is reached as a client of ``MASTER_ADDR:MASTER_PORT``, which torchrun (and torch's
``env://`` rendezvous) sets for every worker: torchrun's agent serves the store there
(``TORCHELASTIC_USE_AGENT_STORE``), or rank 0's ``init_process_group`` does; a client never
binds a port, so it cannot conflict with either (the default process group's own handle on it,
``distributed_c10d._get_default_store``, is private). Keys live under
``plait/liveness/<run id>/<restart>/``, apart from torch's.

Nothing here may hold the run: every store operation runs on a daemon thread of its own
(``plait-stall-view``), publishing drops a record while the one before is still in flight, and a
read is waited for at most ``wait_s``. An unreachable store (a warning, once), or one that stops
answering (on several nodes it is served from rank 0's, which may be the node that is lost), leaves
the stall line without the cross-rank part, and the line says why (:meth:`PeerView.silence`). Publishing costs one small ``set`` per phase change, at most one per
``every_s`` (a tenth of the stall timeout), from the watchdog's thread, never the step's.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from core.contract import log

STORE_TIMEOUT_S = 30.0  # connecting, and each store operation


class PeerView:
    """This rank's window on the others: ``connect()`` returns the store (called on the view's thread)."""

    def __init__(self, rank: int, world_size: int, connect: Callable[[], Any], every_s: float, where: str = "") -> None:
        self.rank, self.world_size, self.every_s = rank, world_size, every_s
        self.where = where  # host:port of the store, for a line that says it did not answer
        self.store: Any = None
        self.broken = ""  # why the store cannot be used
        self.last_sent: tuple = ()
        self.last_sent_at = float("-inf")
        self.in_flight: Future | None = None  # the last record sent
        self.unanswered: Future | None = None  # the last read
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, args=(connect,), name="plait-stall-view", daemon=True).start()

    @classmethod
    def from_env(cls, rank: int, world_size: int, every_s: float) -> PeerView | None:
        """The view through the rendezvous store of a torchrun job; None for one process, or without one."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        if world_size < 2 or not host or not port.isdigit():
            return None
        prefix = f"plait/liveness/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"

        def connect() -> Any:
            import torch.distributed as dist

            timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
            return dist.PrefixStore(prefix, store)

        return cls(rank, world_size, connect, every_s, f"{host}:{port}")

    # -- the view's thread ---------------------------------------------------
    def _serve(self, connect: Callable[[], Any]) -> None:
        try:
            self.store = connect()
        except Exception as e:  # noqa: BLE001 - an unreachable store only costs the line its cross-rank part
            self.broken = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warn(
                f"rank {self.rank}: the stall watchdog cannot reach the rendezvous store ({self.broken}); a stall line will not say what the other ranks were doing",
                all_ranks=True,
            )
        while True:
            job, done = self.jobs.get()
            try:
                if self.store is None:
                    raise ConnectionError(self.broken)
                done.set_result(job(self.store))
            except Exception as e:  # noqa: BLE001 - see above
                done.set_exception(e)

    def _submit(self, job: Callable[[Any], Any]) -> Future:
        done: Future = Future()
        self.jobs.put((job, done))
        return done

    def _wait(self, job: Callable[[Any], Any], wait_s: float) -> Any:
        """``job(store)``'s result, or None when the store fails or does not answer within ``wait_s``
        (or still has not answered an earlier request: a hung store gets no queue of them)."""
        if self.unanswered is not None and not self.unanswered.done():
            return None
        self.unanswered = self._submit(job)
        try:
            return self.unanswered.result(timeout=wait_s)
        except Exception:  # noqa: BLE001 - a timeout or the store's error: no view
            return None

    # -- what the watchdog calls -----------------------------------------------
    def publish(self, record: dict, now: float, force: bool = False) -> None:
        """Send this rank's record if it changed, at most once per ``every_s`` (``force``: now); never blocks."""
        key = (record["doing"], tuple(record["place"]), record["moved"])
        if key == self.last_sent or self.broken or (self.in_flight is not None and not self.in_flight.done()):
            return
        if not force and now - self.last_sent_at < self.every_s:
            return
        self.last_sent, self.last_sent_at = key, now
        value = json.dumps(record)
        self.in_flight = self._submit(lambda store: store.set(f"rank{self.rank}", value))

    def read(self, wait_s: float, ranks: list[int] | None = None) -> dict[int, dict] | None:
        """The last record of every rank (or of ``ranks``); ranks that never published are left
        out; None: no view."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        keys = [f"rank{r}" for r in ranks]

        def job(store: Any) -> dict[int, dict]:
            if store.check(keys):
                return {r: json.loads(v) for r, v in zip(ranks, store.multi_get(keys))}
            return {r: json.loads(store.get(k)) for r, k in zip(ranks, keys) if store.check([k])}

        return self._wait(job, wait_s)

    def silence(self) -> str:
        """Why no rank's phase could be read: the store never connected, or stopped answering."""
        at = f" at {self.where}" if self.where else ""
        if self.broken:
            return f"the rendezvous store{at} could not be reached ({self.broken})"
        return f"the rendezvous store{at} did not answer (it is served from rank 0's node, which may be the one lost)"

    def end(self) -> None:
        """Tell the others that this rank ends the run as stalled (does not wait)."""
        self._submit(lambda store: store.compare_set("ended", "", str(self.rank)))

    def ended_by(self, wait_s: float) -> int | None:
        """The rank that ended the run as stalled, if one has (one cheap check)."""
        found = self._wait(lambda store: store.get("ended") if store.check(["ended"]) else None, wait_s)
        return int(found) if found else None


def holder(records: dict[int, dict]) -> int:
    """The rank the others wait for: the furthest behind in the loop, then in its phase the longest."""
    return min(records, key=lambda r: (records[r]["place"], records[r]["since"], r))


def waiting_for(me: int, records: dict[int, dict], wall_now: float, moving_s: float) -> int | None:
    """A rank at or behind this one's place in the loop that moved within ``moving_s``: this rank
    may be waiting for a straggler, not stalled. None: no such rank."""
    mine = records.get(me)
    if mine is None:
        return None
    for r, rec in sorted(records.items()):
        if r != me and rec["place"] <= mine["place"] and wall_now - rec["moved"] < moving_s:
            return r
    return None


def describe(me: int, records: dict[int, dict], world_size: int, wall_now: float, most: int = 4) -> str:
    """The cross-rank part of a stall line: the holder, then what the other ranks are doing."""
    first = holder(records)
    rec = records[first]
    who = f"rank {first}" + (" (this rank)" if first == me else "")
    text = f"the rank furthest behind is {who}: {rec['doing']} for {wall_now - rec['since']:.0f} s (no progress for {wall_now - rec['moved']:.0f} s)"
    groups: dict[str, list[int]] = {}
    for r in sorted(records):
        if r != first:
            groups.setdefault(records[r]["doing"], []).append(r)
    parts = []
    ordered = sorted(groups.items(), key=lambda g: g[1][0])
    for doing, ranks in ordered[:most]:
        age = max(wall_now - records[r]["since"] for r in ranks)
        parts.append(f"{_ranks(ranks)} {doing} for {'up to ' if len(ranks) > 1 else ''}{age:.0f} s")
    if len(ordered) > most:
        more = sum(len(ranks) for _, ranks in ordered[most:])
        parts.append(f"{more} more rank{'s' if more > 1 else ''} elsewhere")
    unseen = [r for r in range(world_size) if r not in records]
    if unseen:
        parts.append(f"{_ranks(unseen)} never published a phase")
    return text + ("; the others: " + ", ".join(parts) if parts else "")


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-2, 5``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
