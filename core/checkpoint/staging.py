"""An async save's copy of the training state in host memory, made in a background thread.

:func:`torch.distributed.checkpoint.async_save` writes a copy of the state
while training goes on. Making that copy is what holds the training loop: by
default DCP allocates fresh pageable host memory and copies into it before
``async_save`` returns (11 s for the ``1b`` flavor's 15 GB on an H100). This
stager, like torchtitan's pinned-memory async mode, keeps one host buffer per
tensor for the whole run (pinned on CUDA, so the copies run at full PCIe
speed on a side stream) and copies in a background thread, so the copy
overlaps the next forward and backward. The trainer waits for it
(:meth:`core.checkpoint.checkpointer.Checkpointer.wait_for_staging`) before the
optimizer changes the state. It is plait's own rather than DCP's
``DefaultStager`` because under torch 2.11 a ``DefaultStager`` kept for the run
failed on its second save (its copy table had been cleared by ``close()``, which
that version's ``async_save`` calls after each save; seen on an H100).

The host buffers cost as much host memory as the state this rank writes (its
shard under fsdp2, its share of the replicas under ddp: the checkpointer passes
:func:`core.checkpoint.replicas.share`), for as long as the run lasts.
"""

from __future__ import annotations

import contextlib
import copy
import errno
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager


class HostStager(AsyncStager):
    """Copies a state dict's tensors into host buffers kept between saves (``stage`` returns a Future)."""

    _synchronize_after_execute = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.buffers: dict[str, torch.Tensor] = {}  # by the tensor's path in the state dict
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-staging")
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.prepared: Future | None = None  # the allocation ahead of the first save (prepare)

    def stage(self, state_dict: dict[str, Any]) -> Future:  # type: ignore[override]
        if self.stream is not None:  # the copies start after the kernels that wrote the state
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return self.pool.submit(self._copy, state_dict)

    def prepare(self, state_dict: dict[str, Any]) -> Future:
        """Allocate the host buffers for ``state_dict`` in the background (pinning 15 GB takes about
        10 s on an H100 host), so the first save only copies. A ``stage`` queues behind it."""
        self.prepared = self.pool.submit(self._walk, state_dict, "", False)
        return self.prepared

    def out_of_memory(self) -> str:
        """Why the host buffers could not all be allocated ('' if they could, or were not asked for);
        waits for :meth:`prepare` to finish."""
        if self.prepared is None:
            return ""
        error = self.prepared.exception()
        return str(error) if isinstance(error, OSError) and error.errno == errno.ENOMEM else ""

    def held_bytes(self) -> int:
        """The host memory the buffers take."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def synchronize_staging(self) -> None:
        """Nothing to do: ``stage``'s Future is done only once the copies are."""

    def close(self) -> None:
        """Kept open: DCP calls this after every save (torch 2.11), and the buffers serve the next one."""

    # -- the thread ----------------------------------------------------------
    def _copy(self, state: dict[str, Any]) -> dict[str, Any]:
        on_stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with torch.no_grad(), on_stream:
            out = self._walk(state, "")
        if self.stream is not None:
            self.stream.synchronize()
        return out

    def _walk(self, x: Any, path: str, copy_in: bool = True) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor):  # the local shard on the host, the same placement
            return DTensor(self._tensor(x.to_local(), path, copy_in), x._spec, requires_grad=False)
        if isinstance(x, torch.Tensor):
            return self._tensor(x, path, copy_in)
        if isinstance(x, dict):
            return {k: self._walk(v, f"{path}/{k}", copy_in) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(self._walk(v, f"{path}[{i}]", copy_in) for i, v in enumerate(x))
        return copy.deepcopy(x)

    def _tensor(self, t: torch.Tensor, path: str, copy_in: bool = True) -> torch.Tensor:
        buf = self.buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            try:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda)
            except RuntimeError as e:  # an OSError: the save fails like a full disk, on every rank together
                held = self.held_bytes()
                need = t.numel() * t.element_size()
                raise OSError(
                    errno.ENOMEM,
                    f"no host memory for the async save's copy of {path.lstrip('/')} ({need:,} bytes, with {held:,} held);"
                    f" free host memory or set [checkpoint] async = false ({str(e).splitlines()[0]})",
                ) from e
            self.buffers[path] = buf
        if copy_in:
            buf.copy_(t.detach(), non_blocking=self.cuda)
        return buf
