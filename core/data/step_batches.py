"""One step's micro-batches, fetched before any compute, and what the ranks do when one of them has none.

The training loop asks :class:`StepBatches` for the next step's ``grad_accum`` micro-batches. Three
things can stop a step before it starts:

- the data ran out (:class:`core.data.indexed.DataExhausted`, or ``StopIteration``);
- a record is bad (:class:`core.contract.errors.DataError`): every rank stops with exit 2;
- on a loader whose end can differ between ranks (``may_end``), another rank met one of the two.

A ``may_end`` loader costs one small all-reduce per step, so every rank knows before the step's
collectives. The ranks then stop together, with a checkpoint of the step before, and each rank's
data position is put back to where that step left it: the batches a rank read for the step that
never ran are read again on resume (:class:`HeldPosition`).

A loader that is not ``may_end`` ends at the same step on every rank, but a bad record is met by one
rank alone, and the others are in the step's collectives by then. That rank joins the step with
stand-in batches (``void``): its loss is NaN, so every rank skips the update, and all stop without
a checkpoint. The last complete checkpoint stays.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from core.contract import log
from core.contract.errors import DataError
from core.contract.protocols import DataLoaderLike, DistInfo, loader_may_end, loader_state_per_rank
from core.data.indexed import DataExhausted, check_batch
from core.data.prefetch import PrefetchingLoader


class HeldPosition:
    """The loader of a run that is stopping before a step: its ``state_dict()`` is the position
    before that step (what the final checkpoint saves); it is not read again."""

    def __init__(self, loader: DataLoaderLike, position: dict[str, Any]) -> None:
        self.position = position
        self.may_end = loader_may_end(loader)
        self.per_rank_state = loader_state_per_rank(loader)

    def __iter__(self):
        raise RuntimeError("the run is stopping: its loader is held at the position of its last step")

    def state_dict(self) -> dict[str, Any]:
        return self.position

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state


class StepBatches:
    """Fetches each step's micro-batches for the trainer; see the module docstring."""

    def __init__(self, state, grad_accum: int, control, dist: DistInfo, data_name: str, timing) -> None:
        self.state, self.grad_accum, self.control, self.dist, self.data_name = state, grad_accum, control, dist, data_name
        self.timing = timing  # core.loop.step_metrics.StepMetrics: the time spent fetching goes into data_wait_s
        self.void = False  # this rank has no data for the step: it joins with a loss of NaN, skipped by all

    def fetch(self, batches, spec) -> tuple[list | None, str]:
        """``(micro_batches, "")``, or ``(None, why)`` when every rank stops before this step
        (``run.stop`` is set for a bad record)."""
        loader, run = self.state.loader, self.state.run
        may_end = loader_may_end(loader)
        before = loader.state_dict() if may_end else None  # a snapshot (DataLoaderLike): later reads leave it as it is
        t_wait = time.perf_counter()
        micro: list = []
        why, bad, met = "", 0, False
        try:
            for _ in range(self.grad_accum):
                micro.append(next(batches))
        except DataExhausted as e:
            why = str(e)
        except StopIteration:
            why = "[data] the source reached the end of its data"
        except DataError as e:
            why, bad, met = f"bad data: {e}", 2, True  # met: this rank read the record
        for batch in micro:  # held to DataLoaderLike's shape: a plugin's own loader is not IndexedLoader
            check_batch(batch, spec, self.data_name)
        self.timing.data_wait_s += time.perf_counter() - t_wait
        if may_end:
            ended, bad = self.control.agree([int(bool(why)), bad], "max")
            if ended and not why:
                why = "bad data on another rank" if bad else "the data ran out on another rank"
            if ended:
                self.hold(before)
        elif bad and self.dist.world_size > 1:  # the others are in the step already: join it with
            log.error(f"rank {self.dist.rank}: {why}; stopping without a checkpoint (this step is skipped on every rank)", all_ranks=True)
            run.request_stop(why, checkpoint=False, source="data", exit_code=2)  # batches whose update every rank
            self.void = True  # skips (a NaN loss), so that no rank waits for this one
            return [(torch.zeros(spec.micro_batch, spec.seq_len, dtype=torch.long),) * 2] * self.grad_accum, ""
        if bad:
            if met:
                log.error(f"rank {self.dist.rank}: {why}; stopping with a checkpoint of step {run.step}", all_ranks=True)
            run.request_stop(why, checkpoint=True, source="data", exit_code=2)
        return (None, why) if why else (micro, "")

    def hold(self, position: dict[str, Any] | None) -> None:
        """Every rank stops before this step: keep the position from before it for the final checkpoint."""
        if position is None:
            return
        if isinstance(self.state.loader, PrefetchingLoader):
            self.state.loader.close()
        self.state.loader = HeldPosition(self.state.loader, position)
