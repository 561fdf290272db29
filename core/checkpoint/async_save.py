"""Async saves' machinery: :class:`AsyncSaves` keeps the host copy of the state made in a background
thread (:mod:`core.checkpoint.staging`) that the optimizer waits for, falls back to sync saves when
host memory for it is short, and holds the save in flight until every rank sees it written."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from core.checkpoint.checkpoint_dir import CheckpointDir
from core.checkpoint.save_contents import SaveContents
from core.contract import log
from core.runtime import watchdog

if TYPE_CHECKING:
    from core.checkpoint.safe_dcp import HashingFileSystemWriter
    from core.checkpoint.staging import HostStager


class PendingSave(NamedTuple):
    """An async save being written: its files are done when ``future`` is; ``writer`` then holds the shards' checksums."""

    future: Future
    step: int
    path: Path
    json_state: dict[str, Any]
    writer: HashingFileSystemWriter


class AsyncSaves:
    """The async saves of ``contents`` into ``where``: one in flight at a time (:attr:`pending`), its
    host copy made in the background (:attr:`copying`) into the buffers of :attr:`stager`, kept for
    the run (pinned on CUDA; ``None`` until the first async save or :meth:`prepare`)."""

    def __init__(self, where: CheckpointDir, contents: SaveContents) -> None:
        self.where, self.contents = where, contents
        self.stager: HostStager | None = None
        self.copying: Future | None = None  # the copy of the state of the save in flight, still being made
        self.pending: PendingSave | None = None
        self.sync_fallback = False  # async saves were asked for, but the host memory for their copy is short
        self.held_said = False  # the host memory of the copies, said once

    def host_stager(self) -> HostStager:
        """The run's :class:`core.checkpoint.staging.HostStager`, made at its first use."""
        if self.stager is None:
            from core.checkpoint.staging import HostStager

            self.stager = HostStager(self.where.dist.device)
        return self.stager

    def possible(self) -> bool:
        """False, on every rank, once any rank could not allocate the host buffers of async saves:
        the run goes on with sync saves (said once) rather than stop at its first save."""
        short = self.stager.out_of_memory() if self.stager is not None else ""
        if self.where.agree(int(not short), "min"):
            return True
        if not self.sync_fallback:
            self.sync_fallback = True
            why = short or "another rank had no host memory for its copy"
            log.warn(f"async saves need host memory for a copy of the state and {why}; saving synchronously from now on", all_ranks=bool(short))
        return False

    def prepare(self, optimizer: torch.optim.Optimizer) -> None:
        """Once ``optimizer``'s state exists, have the host buffers allocated in the background, so
        that the first save does not hold training while they are pinned (once per run)."""
        if self.stager is None and optimizer.state:
            self.host_stager().prepare(self.contents.written_share(self.contents.dcp_state()))

    def wait_for_copy(self, step: int) -> float:
        """Block until the copy of the state of the save in flight (of ``step``) is made; the
        seconds waited. A failed copy is left for the save's own future to report."""
        if self.copying is None:
            return 0.0
        dist = self.where.dist
        watchdog.progress(f"waiting for the async save's copy of the state (step {step})", waits=True)
        t0 = time.perf_counter()
        copying, self.copying = self.copying, None
        try:
            copying.result()
        except BaseException:  # noqa: BLE001 - the upload future fails with it; the wait for the save reports that
            pass
        else:
            if not self.held_said and dist.is_main and self.stager is not None:
                self.held_said = True
                pinned = ", pinned" if dist.device.type == "cuda" else ""
                log.info(f"async saves keep {self.stager.held_bytes() / 2**20:,.1f} MiB of host memory on rank 0 for their copy{pinned} (each rank its share)")
        waited = time.perf_counter() - t0
        if waited >= 0.1 and dist.is_main:
            log.info(f"checkpoint step {step}: training waited {waited:.3f} s more for the async save's copy of the state")
        return waited

    def start(self, state: dict[str, Any], writer: HashingFileSystemWriter, step: int, path: Path, json_state: dict[str, Any]) -> None:
        """Start writing ``state`` with ``writer`` (``dcp.async_save``); it is :attr:`pending` until taken."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        group = self.where.group
        response = dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=group is None, async_stager=self.host_stager())
        assert isinstance(response, AsyncSaveResponse), "a stager that returns a Future gets both futures back"
        self.copying = response.staging_completion
        self.pending = PendingSave(response.upload_completion, step, path, json_state, writer)

    def written_everywhere(self) -> bool:
        """Whether the save in flight is written on every rank (never blocks). While a save is in
        flight, one small all-reduce per call makes every rank answer the same at the same step."""
        if self.pending is None:
            return False
        not_done = int(not self.pending.future.done())
        if self.where.dist.world_size > 1:
            not_done = self.where.control.agree(not_done, "max")
        return not not_done

    def take(self) -> PendingSave | None:
        """The save in flight, which the caller now commits or fails; none is in flight after."""
        pending, self.pending = self.pending, None
        return pending
