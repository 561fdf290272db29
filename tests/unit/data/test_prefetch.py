"""core.data.prefetch: the threaded loader hands over the same batches, positions and errors, at the same
steps, as the loader read synchronously; on CPU the loop gets the loader itself (no thread).

The threaded path is forced on CPU (no pinned memory); its CUDA parts are in tests/e2e/test_cuda.py."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from core.contract.errors import DataError
from core.contract.protocols import LoaderSpec, loader_may_end
from core.data.indexed import DataExhausted, IndexedSource
from core.data.prefetch import PrefetchingLoader, prefetching

SEQ, MICRO, ACCUM = 8, 2, 3


class Counting(IndexedSource):
    """Sample i is [i, i+1, ...]: every batch names its indices. Ends or breaks at chosen samples."""

    def __init__(self, end_at: int | None = None, bad_at: int | None = None, stop_at: int | None = None):
        self.end_at, self.bad_at, self.stop_at = end_at, bad_at, stop_at

    def sample(self, index, seq_len, split):
        if self.bad_at is not None and index >= self.bad_at:
            raise DataError(f"corpus.bin: bad record at sample {index}")
        return np.arange(index, index + seq_len + 1, dtype=np.int64)

    def check_step(self, first, end):
        if self.end_at is not None and end > self.end_at:
            raise DataExhausted(f"[data] ran out at sample {first}")


class StopsLoader:
    """A finite loader that ends with StopIteration in the middle of a step (a plain iterator)."""

    def __init__(self, n: int):
        self.n, self.pos = n, 0

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            row = torch.arange(self.pos - 1, self.pos + SEQ).expand(MICRO, SEQ + 1)
            yield row[:, :-1], row[:, 1:]

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def spec(dp_rank=0, dp_size=1):
    return LoaderSpec(seq_len=SEQ, micro_batch=MICRO, grad_accum=ACCUM, dp_rank=dp_rank, dp_size=dp_size, seed=0)


def run_steps(loader, steps):
    """What the trainer's fetch of a step's batches (core.data.step_batches) does, step by step: (first ids of each micro-batch,
    the loader position after the step, the error that ended it) per step."""
    it = iter(loader)
    out = []
    for _ in range(steps):
        firsts, error = [], None
        try:
            for _ in range(ACCUM):
                x, y = next(it)
                assert torch.equal(x[:, 1:], y[:, :-1])
                firsts.append(x[:, 0].tolist())
        except (DataExhausted, StopIteration, DataError) as e:
            error = type(e).__name__
        out.append((firsts, loader.state_dict(), error))
        if error:
            break
    return out


def threaded(loader):
    p = prefetching(loader, ACCUM, torch.device("cpu"), force_thread=True)
    assert isinstance(p, PrefetchingLoader) and not p.pin_memory
    return p


def test_cpu_gets_the_loader_itself():
    loader = Counting().loader(spec())
    assert prefetching(loader, ACCUM, torch.device("cpu")) is loader


@pytest.mark.parametrize(
    "make",
    [
        lambda: Counting().loader(spec()),
        lambda: Counting().loader(spec(dp_rank=1, dp_size=2)),
        lambda: Counting(end_at=5 * MICRO * ACCUM).loader(spec()),  # DataExhausted at step 6
        lambda: Counting(bad_at=4 * MICRO * ACCUM + MICRO).loader(spec()),  # DataError, 2nd micro-batch of step 5
        lambda: StopsLoader(4 * ACCUM + 1),  # StopIteration, 2nd micro-batch of step 5
    ],
    ids=["plain", "rank1of2", "exhausted", "bad-record", "stop-iteration"],
)
def test_threaded_matches_synchronous(make):
    sync = run_steps(make(), 8)
    pre = threaded(make())
    assert run_steps(pre, 8) == sync
    pre.close()
    errors = [e for _, _, e in sync if e]
    assert len(errors) <= 1 and (len(sync) == 8 or errors)


def test_error_surfaces_at_the_same_step_after_the_batches_before_it():
    bad = 4 * MICRO * ACCUM + MICRO
    got = run_steps(threaded(Counting(bad_at=bad).loader(spec())), 8)
    firsts, position, error = got[-1]
    assert len(got) == 5 and error == "DataError"
    assert firsts == [[4 * MICRO * ACCUM, 4 * MICRO * ACCUM + 1]]  # the one micro-batch before the bad one
    assert position == {"consumed_samples": 4 * MICRO * ACCUM}  # the completed steps only


def test_position_is_what_was_consumed_not_what_was_fetched():
    pre = threaded(Counting().loader(spec()))
    it = iter(pre)
    for _ in range(2 * ACCUM):
        next(it)
    deadline = time.monotonic() + 120
    while pre.inner.state_dict()["consumed_samples"] <= 2 * MICRO * ACCUM:  # the thread has read ahead
        assert time.monotonic() < deadline, "the prefetch thread never read ahead"
        time.sleep(0.01)
    assert pre.state_dict() == {"consumed_samples": 2 * MICRO * ACCUM}
    next(it)  # inside step 3: not yet consumed
    assert pre.state_dict() == {"consumed_samples": 2 * MICRO * ACCUM}
    pre.close()


def test_resume_and_reiterate_from_the_consumed_position():
    reference = run_steps(Counting().loader(spec()), 6)
    pre = threaded(Counting().loader(spec()))
    first = run_steps(pre, 3)
    saved = pre.state_dict()
    # a new iter() of the same wrapper (the trainer after a rollback) continues from the consumed position
    assert run_steps(pre, 3) == reference[3:]
    pre.close()
    # a fresh run loading the saved position (a resume) serves the same steps
    resumed = threaded(Counting().loader(spec()))
    resumed.load_state_dict(saved)
    assert first + run_steps(resumed, 3) == reference
    resumed.close()


def test_flags_of_the_inner_loader_are_kept():
    loader = Counting().loader(spec())
    loader.may_end = True
    assert loader_may_end(threaded(loader))
    assert not loader_may_end(threaded(Counting().loader(spec())))


def test_a_thread_that_fails_before_fetching_raises_in_the_consumer(monkeypatch):
    """The thread's set-up (on CUDA: choosing its device) can fail. The consumer then gets that
    error at its first batch, with the position unchanged, instead of waiting forever for a
    batch that never comes (what bench.overhead did on the first H100)."""
    import types

    pre = threaded(Counting().loader(spec()))
    pre.device = types.SimpleNamespace(type="cuda")  # the thread takes the CUDA set-up path

    def refuse(device):
        raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    it = iter(pre)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="specified index"):
        next(it)
    assert time.monotonic() - t0 < 60  # not the wait for a batch that never comes (forever); room for a loaded machine
    assert pre.state_dict() == {"consumed_samples": 0}
    pre.close()
