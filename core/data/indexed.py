"""Helpers for data sources addressed by global sample index.

A map-style source implements ``sample(index, seq_len, split)`` returning
``seq_len + 1`` token ids. :class:`IndexedLoader` lays the samples of each
optimizer step out over ranks and micro-steps::

    step s, micro-step m, rank r, row j  ->  index = start + s*G + m*(B*D) + r*B + j

with ``G = B * A * D`` (micro-batch B, accumulation A, data-parallel size D).
Every step consumes the same ``G`` consecutive global indices whatever the
world size, so a run resumed on another number of ranks continues the same
stream with no sample repeated or skipped. Randomness belongs in
``sample`` and must come from ``(seed, index)`` alone.

Before the first micro-batch of a training step the loader calls
``source.check_step(first, end)`` with the step's whole global index range, the
same on every rank; a source that has run out raises :class:`DataExhausted`
there, so every rank stops at the same step and none is left waiting inside a
collective.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any, Iterator

import numpy as np
import torch

from core.contract import log
from core.contract.errors import PluginError
from core.contract.protocols import LoaderSpec


class DataExhausted(Exception):
    """A finite source ran out and is configured to end the run (not an error: the run stops
    with a checkpoint and exit code 0)."""


class IndexedSource:
    """Base class for map-style data sources: samples are a pure function of ``(seed, index)``.

    A subclass implements :meth:`sample`; its constructor takes the plugin's options
    dataclass (the factory registered with ``registry.add``). The core calls
    :meth:`loader` with the run's :class:`core.api.LoaderSpec`, which sets
    :attr:`seed` from ``train.seed`` before any sample is drawn: read ``self.seed`` in
    ``sample``, never a global RNG; the spec's ``vocab_size`` (the model's) bounds every sample's
    ids. Raise :class:`core.api.DataError` (one line naming the file) for bad data. Finite sources also implement :meth:`epoch_samples`, and may
    end the run through :meth:`check_step`.
    """

    seed: int = 0

    def sample(self, index: int, seq_len: int, split: str) -> np.ndarray:
        """Sample ``index`` of ``split`` (``"train"`` or ``"val"``): a 1-D numpy integer array (not a torch tensor) of exactly
        ``seq_len + 1`` token ids; the loader makes inputs of the first ``seq_len`` and labels of
        the last ``seq_len`` (-100: ignored). Checked on every sample; a wrong shape is one line."""
        raise NotImplementedError

    def loader(self, spec: LoaderSpec) -> "IndexedLoader":
        self.seed = spec.seed
        return IndexedLoader(self, spec)

    def epoch_samples(self, seq_len: int, split: str) -> int | None:
        """Distinct samples in one pass over ``split`` at ``seq_len``, or None when the source never
        runs out (the default).

        The loader does nothing at an epoch's end: it keeps asking :meth:`sample` for the next global
        indices, so index ``epoch_samples`` is the first sample of the second pass, and the source
        maps indices past one epoch itself (``token_bin`` with ``order = "epochs"`` takes
        ``divmod(index, epoch_samples)`` and shuffles each epoch anew). To end the run instead,
        raise :class:`DataExhausted` from :meth:`check_step`. A ``mixture`` reads this number to
        serve each of its sources without repeats and to wrap or stop it (its ``on_exhausted``); the
        logged ``epoch`` comes from the source's ``tokens_per_epoch()``, not from here.
        """
        return None

    def check_step(self, first: int, end: int) -> None:
        """Called with each step's global index range ``[first, end)`` before its first
        micro-batch, identically on every rank; raise :class:`DataExhausted` to end the run."""


def check_batch(batch: Any, spec: LoaderSpec, name: str) -> None:
    """A loader's micro-batch as :class:`core.contract.protocols.DataLoaderLike` declares it: ``(inputs, labels)``,
    two integer tensors of shape ``[micro_batch, seq_len]`` of the loader's spec; else one line naming
    the data plugin, so a loader of the plugin's own never trains on whatever it yields. No device sync."""
    shape = (spec.micro_batch, spec.seq_len)
    pair = isinstance(batch, (tuple, list)) and len(batch) == 2
    if pair and all(isinstance(t, torch.Tensor) and tuple(t.shape) == shape and not (t.dtype.is_floating_point or t.dtype == torch.bool) for t in batch):
        return
    got = ", ".join(f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in batch) if pair else type(batch).__name__
    raise PluginError(f"data {name!r}: its loader yielded {got}; expected (inputs, labels), two integer tensors of shape {shape} (micro_batch x seq_len)")


def check_replacement_batch(result: Any, inputs: Any, labels: Any, vocab_size: int | None) -> None:
    """A monitor's replacement batch (``plait_replace_batch``) must be an (inputs, labels) pair of integer tensors shaped like the real
    one, its ids below ``vocab_size`` (labels may also be -100, ignored by the loss). A host sync,
    paid only on the steps a monitor replaces a batch."""
    ok = isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)
    if not ok or tuple(result[0].shape) != tuple(inputs.shape) or tuple(result[1].shape) != tuple(labels.shape):
        raise TypeError(f"returned {type(result).__name__}; expected None or (inputs, labels) shaped {tuple(inputs.shape)} and {tuple(labels.shape)}")
    if result[0].dtype.is_floating_point or result[1].dtype.is_floating_point or result[0].dtype == torch.bool:
        raise TypeError(f"returned tensors of {result[0].dtype} and {result[1].dtype}; expected integer token ids")
    if vocab_size is not None and result[0].numel():
        lo, hi = int(result[0].min()), int(result[0].max())
        ok_labels = result[1][result[1] != -100]
        if ok_labels.numel():
            lo, hi = min(lo, int(ok_labels.min())), max(hi, int(ok_labels.max()))
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"returned token ids from {lo} to {hi}; expected ids in 0..{vocab_size - 1} (the model's vocabulary)")


def checked_sample(source: IndexedSource, index: int, seq_len: int, split: str, vocab_size: int | None = None, name: str = "") -> np.ndarray:
    """``source.sample(...)``, refused with one line unless it is a numpy array of ``seq_len + 1`` integer token ids,
    below ``vocab_size`` when given (the last id, a label only, may also be -100: ignored). ``name``:
    the plugin's, for the message (else the source's class)."""
    from core.contract.errors import DataError

    row = source.sample(index, seq_len, split)
    shape = getattr(row, "shape", None)
    where = f"{f'data {name!r}' if name else f'data source {type(source).__name__}'}: sample({index}, seq_len={seq_len}, {split!r}) returned"
    if isinstance(row, torch.Tensor):
        raise PluginError(
            f"{where} a torch.Tensor ({row.dtype}); expected a numpy integer array of seq_len + 1 = {seq_len + 1} token ids (tensor.numpy() gives one)"
        )
    if shape != (seq_len + 1,) or not np.issubdtype(getattr(row, "dtype", np.float64), np.integer):
        raise DataError(
            f"{where} {type(row).__name__} of shape {shape} and dtype {getattr(row, 'dtype', '?')}; expected a 1-D "
            f"integer array of seq_len + 1 = {seq_len + 1} token ids (inputs, then the labels shifted by one)"
        )
    if vocab_size is not None:
        ids = row if row[-1] != -100 else row[:-1]
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise DataError(f"{where} token ids from {lo} to {hi}; expected ids in 0..{vocab_size - 1} (the model's vocabulary)")
    return row


class IndexedLoader:
    """Yields this rank's micro-batches ``(inputs, labels)`` forever; resumable by sample count."""

    def __init__(self, source: IndexedSource, spec: LoaderSpec) -> None:
        self.source = source
        self.spec = spec
        self._start = 0  # global samples consumed before this loader's first step
        self._micro = 0  # micro-batches yielded by this loader

    @property
    def consumed_samples(self) -> int:
        """Global samples consumed by completed steps (counts every rank)."""
        return self._start + (self._micro // self.spec.grad_accum) * self.spec.global_batch

    def indices(self, micro: int) -> list[int]:
        s = self.spec
        step, m = divmod(micro, s.grad_accum)
        base = self._start + step * s.global_batch + m * s.micro_batch * s.dp_size + s.dp_rank * s.micro_batch
        return list(range(base, base + s.micro_batch))

    def step_range(self, micro: int) -> tuple[int, int]:
        """The global index range of the step that micro-batch ``micro`` belongs to."""
        first = self._start + (micro // self.spec.grad_accum) * self.spec.global_batch
        return first, first + self.spec.global_batch

    def row(self, index: int) -> np.ndarray:
        return checked_sample(self.source, index, self.spec.seq_len, self.spec.split, self.spec.vocab_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            if self._micro % self.spec.grad_accum == 0 and self.spec.split == "train":
                self.source.check_step(*self.step_range(self._micro))
            rows = [self.row(i) for i in self.indices(self._micro)]
            self._micro += 1
            batch = torch.from_numpy(np.stack(rows).astype(np.int64, copy=False))
            yield batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._start = int(state["consumed_samples"])
        self._micro = 0


def ignore_stop_signals(worker_id: int = 0) -> None:
    """``worker_init_fn`` for DataLoader worker processes: ignore SIGINT, SIGTERM and SIGHUP.

    Workers share the process group of their rank, so a Ctrl-C, a pre-emption's
    SIGTERM or a closed terminal's SIGHUP reaches them too; a worker that dies of it makes the rank crash instead of
    stopping at the step boundary with a checkpoint. The rank's main process alone
    decides when to stop and ends its workers; should it die, its fork server ends
    (:mod:`core.data.worker_start`, whose keep-alive pipe the worker lets go of here),
    and torch's worker loop notices the lost parent and exits within a few seconds (a
    SIGKILL of the whole process group still ends them at once).
    """
    import signal

    from core.runtime import ownership

    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, signal.SIG_IGN)
    # A worker forked from rank 0 (a loader without worker_context) inherits its run-folder lock (flock);
    # closing its copies leaves the rank's lock in place, but a worker outliving a killed rank no longer keeps it.
    ownership.release_run_folders()
    from core.data.worker_start import let_go_of_server

    let_go_of_server()  # started from the fork server (core.data.worker_start): end with the rank, not outlive it


_WORKER_ITERATORS: weakref.WeakSet[Any] = weakref.WeakSet()
_HOOKED = False


def _shut_down_workers() -> None:
    for it in list(_WORKER_ITERATORS):
        try:
            it._shutdown_workers()
        except (OSError, RuntimeError, AttributeError, ValueError) as e:  # best effort at exit
            log.warn(f"shutting down loader workers: {type(e).__name__}: {e}")
    from core.data.worker_start import end_workers, server_pid

    if _WORKER_ITERATORS or server_pid() is not None:  # multiprocessing's own exit steps, which os._exit skips: the
        from multiprocessing import util  # named semaphores of the workers' queues (core.data.worker_start) are unlinked,
        # not reported leaked; then, its workers ended, the fork server's temporary folder is removed (every run left it in TMPDIR)

        util._run_finalizers(0)  # type: ignore[attr-defined]
        end_workers()
        util._run_finalizers()  # type: ignore[attr-defined]


def shut_down_at_exit(iterator: Any) -> Any:
    """Register a multi-process DataLoader iterator to be shut down at interpreter exit.

    Workers that ignore SIGTERM (:func:`ignore_stop_signals`) cannot be ended by
    multiprocessing's exit hook (SIGTERM, then an unbounded join), and torch skips its
    own orderly shutdown once the interpreter is exiting; an iterator still referenced
    then (by a signal handler's trainer, a traceback) would hang the exit. This hook is
    registered after torch's, so it runs first and shuts the workers down normally.
    """
    global _HOOKED
    if hasattr(iterator, "_shutdown_workers"):
        if not _HOOKED:
            atexit.register(_shut_down_workers)
            _HOOKED = True
        _WORKER_ITERATORS.add(iterator)
    return iterator


def mix_seed(*parts: int) -> int:
    """A 64-bit seed from integers (splitmix64 over the parts): cheap and stable across platforms."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x = z ^ (z >> 31)
    return x


def permute(position: int, n: int, key: int) -> int:
    """A pseudo-random bijection of ``range(n)`` keyed by ``key``: a 4-round Feistel network on
    the smallest even number of bits that covers ``n``, cycle-walking values outside the range.
    O(1) memory, so shuffling an epoch of any size needs no index array."""
    if n <= 1:
        return 0
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = position
    while True:
        left, right = x >> half, x & mask
        for r in range(4):
            left, right = right, left ^ (mix_seed(key, r, right) & mask)
        x = (left << half) | right
        if x < n:
            return x
