"""Keeping non-finite numbers away from the weights and the checkpoints.

Every step, the loss and the global gradient norm are checked on the device.
A step where either is NaN or infinite on any rank is *skipped*: the update is
not applied, and every rank skips the same step. This costs no host sync where
the optimizer can skip on the device (torch's fused Adam, AdamW and SGD take a
``found_inf`` flag, the contract ``torch.amp.GradScaler`` uses); other
optimizers need the flag on the host once per step (free on CPU, one small
sync per step on GPU).

The host reads the counters only where it syncs anyway (log and save steps):
more than ``train.max_nonfinite_steps`` skipped steps in a row stops the run
with exit code 3 and no checkpoint. A checkpoint is only written from finite
parameters and optimizer state (:meth:`core.checkpoint.Checkpointer.save`, which raises
:class:`core.checkpoint.NonFiniteState`).
"""

from __future__ import annotations

import torch
import torch.distributed as tdist

from core.contract.protocols import DistInfo

EXIT_NONFINITE = 3


HISTORY = 1024  # steps whose flags the device keeps between two folds into the counters


class NonFiniteGuard:
    """The per-step check: ``flag()`` after the gradient norm, ``step()`` instead of ``optimizer.step()``.

    Each step writes one flag into a device buffer (three small kernels, where
    ``torch.isfinite`` alone is several per tensor); the counters are folded from the
    buffer on the device when it is full or read, so no step syncs with the host."""

    def __init__(self, optimizer: torch.optim.Optimizer, dist: DistInfo, history: int = HISTORY) -> None:
        # torch's own declaration that step() honours a found_inf tensor (fused kernels)
        self.on_device = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.dist = dist
        self.flags = torch.zeros(history, device=dist.device)  # 1.0 for each skipped step since the last fold
        self.written = 0  # flags written since the last fold
        zero = torch.zeros((), device=dist.device)
        self.in_a_row = zero.clone()  # skipped steps in a row, up to the last fold
        self.worst = zero.clone()  # longest run of skipped steps since the last read
        self.skipped = zero.clone()  # skipped steps since the last read

    def flag(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """1.0 if this step must be skipped on every rank, else 0.0 (a device tensor, no sync)."""
        if self.written == len(self.flags):
            self.fold()
        bad = self.flags[self.written]
        # x * 0 is 0 for a finite x and NaN for NaN or inf, and a finite sum of two finite numbers
        # stays finite (a norm within the loss of float32's largest value counts as non-finite).
        torch.nan_to_num((loss.detach().float() + grad_norm.detach().float()) * 0, nan=1.0, out=bad)
        if self.dist.world_size > 1:  # the loss is per rank: every rank must make the same choice
            tdist.all_reduce(bad, op=tdist.ReduceOp.MAX)
        self.written += 1
        return bad

    def fold(self) -> None:
        """Move the flags written since the last fold into the counters (device ops, no sync)."""
        n, self.written = self.written, 0
        if not n:
            return
        f = self.flags[:n]
        at = torch.arange(1, n + 1, device=f.device, dtype=f.dtype)
        last_finite = torch.cummax(torch.where(f > 0.5, 0.0, at), dim=0).values  # 0: none since the fold
        in_a_row = torch.where(last_finite > 0, at - last_finite, at + self.in_a_row)  # after each step
        self.worst = torch.maximum(self.worst, in_a_row.max())
        self.in_a_row = in_a_row[-1].clone()
        self.skipped = self.skipped + (f > 0.5).sum()

    def step(self, optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
        """``optimizer.step()``, unless ``bad``."""
        if self.on_device:
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            optimizer.found_inf = bad  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                optimizer.found_inf = None  # type: ignore[attr-defined]
        elif not bool(bad):
            optimizer.step()

    def read(self) -> tuple[int, int, int]:
        """(steps skipped, longest run of skipped steps) since the last read, and the skipped
        steps in a row up to now; a host sync."""
        self.fold()
        skipped, worst, now = int(self.skipped), int(self.worst), int(self.in_a_row)
        self.skipped.zero_()
        self.worst.copy_(self.in_a_row)
        return skipped, worst, now
