"""Fetching the next step's micro-batches while this step computes (CUDA), with exact resume.

Without it the loader runs in the training loop, between steps, and
``.to(device, non_blocking=True)`` from pageable host memory is a synchronous
copy. :class:`PrefetchingLoader` wraps a loader (``core.contract.protocols.DataLoaderLike``)
and, in one background thread, reads a whole step (``grad_accum`` micro-batches)
ahead, copies them into pinned host memory and starts their host-to-device copies
on a side CUDA stream. The consumer's stream waits on that copy's event before it
uses the batch (no host sync), and the tensors are marked as used by the
consumer's stream so the caching allocator does not recycle them early.

Resume stays exact: the wrapper is itself a loader whose ``state_dict()`` is the
position of the batches *handed to the consumer*, never those fetched ahead. The
thread reads the inner loader's ``state_dict()`` after fetching each step and
hands it over with that step's batches; it becomes the wrapper's position when
the consumer takes the step's last micro-batch (or meets the step's error). A
step the consumer is in the middle of counts as not consumed, as
:class:`core.data.indexed.IndexedLoader` counts it. Errors raised by the inner loader
(``DataExhausted``, ``StopIteration``, ``DataError``...) are raised to the
consumer after the micro-batches fetched before them, at the same step as
without the thread. ``load_state_dict()`` and a new ``iter()`` stop the thread
and restart from the consumed position.

:func:`prefetching` returns the loader unchanged on CPU (no thread, no copy):
CPU runs keep their exact behaviour and determinism.
"""

from __future__ import annotations

import copy
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from core.contract.protocols import DataLoaderLike, loader_may_end, loader_state_per_rank


@dataclass
class _Step:
    """One step's worth from the thread: its micro-batches, the loader position after fetching
    them, and the error that ended the fetch (if any), with the CUDA event of their copies."""

    micro: list[Any] = field(default_factory=list)
    state_after: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    event: Any = None


class PrefetchingLoader:
    """A loader that reads one step ahead in a thread; see the module docstring."""

    def __init__(self, loader: DataLoaderLike, grad_accum: int, device: torch.device, pin_memory: bool | None = None, depth: int = 1) -> None:
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        self.inner = loader
        self.grad_accum = grad_accum
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the thread must name the device it serves
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else pin_memory
        self.depth = depth
        # The optional flags of the inner loader, read through the core's declared accessors.
        self.may_end = loader_may_end(loader)
        self.per_rank_state = loader_state_per_rank(loader)
        self._position = copy.deepcopy(loader.state_dict())  # after the steps the consumer has taken
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._current: _Step | None = None
        self._taken = 0  # micro-batches of ``_current`` handed over
        self._ahead = False  # the inner loader has moved past ``_position``
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # -- the loader protocol -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self._position  # each step's is a new object, never changed afterwards: a snapshot, as DataLoaderLike's

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.inner.load_state_dict(state)
        self._position = copy.deepcopy(self.inner.state_dict())
        self._ahead = False

    def __iter__(self) -> "PrefetchingLoader":
        """Restart the thread from the consumed position (a fresh ``iter()`` of the inner loader)."""
        self.close()
        if self._ahead:
            self.inner.load_state_dict(self._position)
            self._ahead = False
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.depth)
        self._current, self._taken = None, 0
        self._ahead = True
        self._thread = threading.Thread(target=self._fetch_loop, args=(iter(self.inner), self._queue, self._stop), name="plait-prefetch", daemon=True)
        self._thread.start()
        return self

    def __next__(self):
        if self._queue is None:
            raise TypeError("call iter() on the PrefetchingLoader first")
        step = self._current
        if step is None or (self._taken == len(step.micro) and step.error is None):
            step = self._queue.get()
            self._current, self._taken = step, 0
        if self._taken == len(step.micro):  # the step's error, after the micro-batches fetched before it
            self._position = step.state_after
            raise step.error  # type: ignore[misc]  # again on every later call: an ended loader stays ended
        batch = step.micro[self._taken]
        self._taken += 1
        if step.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(step.event)
            for t in batch:
                t.record_stream(current)
        if self._taken == len(step.micro) and step.error is None:
            self._position = step.state_after
        return batch

    def close(self) -> None:
        """Stop the thread (the batches it fetched ahead are dropped; the position is unchanged)."""
        thread, q = self._thread, self._queue
        self._thread = self._queue = None
        if thread is None or q is None:
            return
        self._stop.set()
        while thread.is_alive():
            try:  # unblock a put() on a full queue
                q.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.01)

    # -- the thread ----------------------------------------------------------
    def _fetch_loop(self, it, q: queue.Queue, stop: threading.Event) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
        except BaseException as e:  # noqa: BLE001 - a thread that dies silently would leave the consumer waiting forever
            failed = _Step()
            failed.error = e
            failed.state_after = copy.deepcopy(self._position)
            q.put(failed)
            return
        while not stop.is_set():
            step = _Step()
            try:
                for _ in range(self.grad_accum):
                    step.micro.append(self._stage(next(it)))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                step.error = e
            try:
                step.state_after = copy.deepcopy(self.inner.state_dict())
            except BaseException as e:  # noqa: BLE001
                step.error = step.error or e
            if self._stream is not None:
                step.event = torch.cuda.Event()
                step.event.record(self._stream)
            while not stop.is_set():
                try:
                    q.put(step, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if step.error is not None:
                return

    def _stage(self, batch):
        """Pinned host copies, then (on CUDA) device copies started on the side stream."""
        out = []
        for t in batch:
            if self.pin_memory:
                t = t.pin_memory()
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    t = t.to(self.device, non_blocking=True)
            out.append(t)
        return tuple(out)


def prefetching(loader: DataLoaderLike, grad_accum: int, device: torch.device, force_thread: bool = False):
    """The loader the training loop should read: a :class:`PrefetchingLoader` on CUDA (or with
    ``force_thread``, for tests, without pinned memory on CPU), else ``loader`` itself."""
    device = torch.device(device)
    if device.type == "cuda" or force_thread:
        return PrefetchingLoader(loader, grad_accum, device, pin_memory=device.type == "cuda")
    return loader
