"""On a CUDA device, in this process: the prefetching loader's batches and positions equal the synchronous
loader's. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")


def test_prefetch_on_cuda_matches_the_synchronous_loader():
    """core.data.prefetch on CUDA: pinned host copies, device copies on a side stream; the consumer's
    stream waits for them, and batches and positions equal the synchronous loader's."""
    from core.contract.protocols import LoaderSpec
    from core.data.indexed import IndexedSource
    from core.data.prefetch import PrefetchingLoader, prefetching

    class Counting(IndexedSource):
        def sample(self, index, seq_len, split):
            import numpy as np

            return np.arange(index, index + seq_len + 1, dtype=np.int64)

    spec = LoaderSpec(seq_len=256, micro_batch=4, grad_accum=2, dp_rank=0, dp_size=1, seed=0)
    dev = torch.device("cuda", 0)
    pre = prefetching(Counting().loader(spec), 2, dev)
    assert isinstance(pre, PrefetchingLoader) and pre.pin_memory
    sync, it, got = iter(Counting().loader(spec)), iter(pre), []
    for step in range(5):
        for _ in range(2):
            x, y = next(it)
            assert x.device == dev and y.device == dev
            sx, sy = next(sync)
            got.append(torch.equal(x.cpu(), sx) and torch.equal(y.cpu(), sy))
        assert pre.state_dict() == {"consumed_samples": (step + 1) * 8}
    pre.close()
    assert all(got)
