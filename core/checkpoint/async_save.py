"""An async save's machinery, for :class:`core.checkpoint.checkpointer.Checkpointer`: the host copy
of the state made in a background thread (:mod:`core.checkpoint.staging`) that the optimizer waits
for, the fallback to sync saves when host memory for it is short, and the save in flight polled at
step boundaries and committed (or failed) on every rank at the same step."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from core.checkpoint import save_contents
from core.checkpoint.commit import fail_together
from core.checkpoint.folders import io_error
from core.contract import log
from core.runtime import watchdog

if TYPE_CHECKING:
    from core.checkpoint.checkpointer import Checkpointer


def stager(ck: Checkpointer) -> Any:
    """The run's :class:`core.checkpoint.staging.HostStager`: async saves copy the state into
    host buffers it keeps, in a background thread, while training goes on."""
    if ck._stager is None:
        from core.checkpoint.staging import HostStager

        ck._stager = HostStager(ck.dist.device)
    return ck._stager


def async_possible(ck: Checkpointer) -> bool:
    """False, on every rank, once any rank could not allocate the host buffers of async saves:
    the run goes on with sync saves (said once) rather than stop at its first save."""
    short = ck._stager.out_of_memory() if ck._stager is not None else ""
    if ck.where.agree(int(not short), "min"):
        return True
    if not ck.sync_fallback:
        ck.sync_fallback = True
        why = short or "another rank had no host memory for its copy"
        log.warn(f"async saves need host memory for a copy of the state and {why}; saving synchronously from now on", all_ranks=bool(short))
    return False


def before_update(ck: Checkpointer) -> None:
    """Called before each optimizer step: wait for an async save's copy of the state; and once
    the optimizer state exists, have the host buffers of async saves allocated in the
    background, so that the first save does not hold training while they are pinned."""
    ck.wait_for_staging()
    if ck.opts.async_save and ck._stager is None and ck.state.optimizer.state:
        ck.stager().prepare(save_contents.written_share(ck, ck._dcp_state()))


def wait_for_staging(ck: Checkpointer) -> None:
    """Block until an async save's copy of the state is made. Called before anything changes
    the state (the optimizer step, a load); the wait counts in ``last_stall_s``."""
    if ck.staging is None:
        return
    watchdog.progress(f"waiting for the async save's copy of the state (step {ck.last_saved_step})", waits=True)
    t0 = time.perf_counter()
    staging, ck.staging = ck.staging, None
    try:
        staging.result()
    except BaseException:  # noqa: BLE001 - the upload future fails with it; wait() reports that
        pass
    else:
        if not ck.held_said and ck.dist.is_main:
            ck.held_said = True
            pinned = ", pinned" if ck.dist.device.type == "cuda" else ""
            log.info(f"async saves keep {ck._stager.held_bytes() / 2**20:,.1f} MiB of host memory on rank 0 for their copy{pinned} (each rank its share)")
    waited = time.perf_counter() - t0
    ck.last_stall_s += waited
    if waited >= 0.1 and ck.dist.is_main:
        log.info(f"checkpoint step {ck.last_saved_step}: training waited {waited:.3f} s more for the async save's copy of the state")


def poll(ck: Checkpointer) -> None:
    """Commit a finished async save (called at step boundaries; never blocks). While a
    save is in flight, one small all-reduce per step makes every rank commit (and agree
    on a failure) at the same step."""
    if ck.pending is None:
        return
    not_done = int(not ck.pending[0].done())
    if ck.dist.world_size > 1:
        not_done = ck.where.control.max([not_done])[0]
    if not not_done:
        ck.wait()


def wait(ck: Checkpointer) -> None:
    """Block until the save in flight is written, then commit it."""
    if ck.pending is None:
        return
    ck.wait_for_staging()
    future, step, path, json_state = ck.pending
    watchdog.progress(f"waiting for the async save of step {step} to be written", waits=True)  # its writer's blocks are progress
    ck.pending = None
    error = None
    try:
        future.result()
        ck._commit(step, path, json_state)
    except BaseException as e:
        error = io_error(e)
        if error is None:
            raise
    fail_together(ck, error, step, path)
