"""One training step, apart from the loop (OLMo-core's train module): forward and backward
over a step's micro-batches, the gradient norm, and the update or its skip.

The loop (:mod:`core.loop.trainer`) decides whether the update happens (non-finite
values, monitors' verdicts); this module only does what it is told, without a
host sync: a NaN/inf on any rank is skipped on the device (:mod:`core.loop.nonfinite`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from core.checkpoint import TrainingState
from core.contract.errors import PluginError
from core.contract.members import member
from core.contract.protocols import DistInfo
from core.loop.nonfinite import NonFiniteGuard

Batch = tuple[torch.Tensor, torch.Tensor]


class TrainStep:
    def __init__(
        self,
        state: TrainingState,
        train_model: torch.nn.Module,
        components: dict[str, Any],
        grad_accum: int,
        grad_clip: float,
        dist: DistInfo,
        before_update: Callable[[], None] = lambda: None,
        model_name: str = "model",
    ) -> None:
        """``before_update()`` runs before the optimizer changes the state (the checkpointer waits
        there for an async save's copy of it); ``model_name`` names the model plugin in errors."""
        self.state, self.train_model, self.dist, self.model_name = state, train_model, dist, model_name
        self.before_update = before_update
        self.parallelism, self.precision = components["parallelism"], components["precision"]
        self.grad_accum, self.grad_clip = grad_accum, grad_clip
        self.guard = NonFiniteGuard(state.optimizer, dist)
        self.post_optimizer_step = member("precision", self.precision, "post_optimizer_step")  # fp8 scale precompute after each update
        self.applied_lr: Any = state.optimizer.param_groups[0]["lr"]  # the LR of the last update
        pipelined = member("parallelism", self.parallelism, "pipeline_parallel") > 1
        self.pipeline_step = member("parallelism", self.parallelism, "pipeline_step") if pipelined else None  # replaces the micro-batch loop

    def forward_backward(
        self, micro_batches: list[Batch], replace: Callable[[int, torch.Tensor, torch.Tensor], Batch] | None = None, void: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of the step's mean loss, clipped: ``(loss, grad_norm, bad)``, all on the device;
        ``bad`` is set when the loss or the norm is non-finite on any rank. ``replace(m, inputs, labels)``
        may swap micro-batch ``m`` for another (a monitor's ``plait_replace_batch``). ``void``: this
        rank's batches stand in for data it does not have; its loss is NaN, so every rank skips the update."""
        dev, accum = self.dist.device, self.grad_accum
        if self.pipeline_step is not None:
            return self.pipelined(micro_batches, replace, void)
        loss_sum: torch.Tensor | None = None
        for m, (inputs, labels) in enumerate(micro_batches):
            if replace is not None:
                inputs, labels = replace(m, inputs, labels)
            inputs = inputs.to(dev, non_blocking=True)
            labels = labels.to(dev, non_blocking=True)
            with self.parallelism.sync_context(self.train_model, sync=m == accum - 1):
                with self.precision.autocast(dev):
                    loss = self.train_model(inputs, labels)
                if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):  # a (loss, logits) tuple was a TypeError traceback, exit 1
                    got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
                    raise PluginError(f"{self.model_name}: forward(ids, labels) returned {got}; expected the mean loss, a 0-dim tensor")
                (loss if accum == 1 else loss / accum).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        assert loss_sum is not None, "a step has at least one micro-batch"
        if void:
            loss_sum = loss_sum * float("nan")
        grad_norm = self.parallelism.clip_grad_norm(self.train_model, self.grad_clip)
        bad = self.guard.flag(loss_sum, grad_norm)
        return loss_sum / accum, grad_norm, bad

    def pipelined(
        self, micro_batches: list[Batch], replace: Callable[[int, torch.Tensor, torch.Tensor], Batch] | None, void: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward_backward` through the parallelism's pipeline schedule (``pipeline_step``): the
        same micro-batches, the same mean loss, on every rank."""
        dev = self.dist.device
        batches = [replace(m, *batch) if replace is not None else batch for m, batch in enumerate(micro_batches)]
        batches = [(inputs.to(dev, non_blocking=True), labels.to(dev, non_blocking=True)) for inputs, labels in batches]
        assert self.pipeline_step is not None
        with self.precision.autocast(dev):
            loss = self.pipeline_step(self.train_model, batches)
        if void:
            loss = loss * float("nan")
        grad_norm = self.parallelism.clip_grad_norm(self.train_model, self.grad_clip)
        return loss, grad_norm, self.guard.flag(loss, grad_norm)

    def clip_coef(self, grad_norm: float) -> float:
        """The factor clipping multiplied the gradients by (``plait_before_update``'s ``clip_coef``):
        ``min(1, grad_clip / (grad_norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_`` takes it, 1.0
        without clipping (``train.grad_clip = 0``), NaN when the norm is NaN."""
        if self.grad_clip <= 0:
            return 1.0
        return grad_norm if math.isnan(grad_norm) else min(1.0, self.grad_clip / (grad_norm + 1e-6))

    def update(self, bad: torch.Tensor) -> None:
        """Apply the gradients (unless ``bad``), move the schedule on, clear the gradients."""
        self.before_update()
        optimizer = self.state.optimizer
        lr = optimizer.param_groups[0]["lr"]  # this step's LR: the scheduler moves it on after the update
        self.applied_lr = lr.clone() if isinstance(lr, torch.Tensor) else lr
        self.guard.step(optimizer, bad)
        if self.post_optimizer_step is not None:
            self.post_optimizer_step(self.state.model)
        self.state.scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    def skip_update(self) -> None:
        """Drop the gradients; the schedule still moves on (a monitor's "skip" verdict)."""
        self.state.optimizer.zero_grad(set_to_none=True)
        self.state.scheduler.step()

    def lr(self) -> float:
        """The LR the last update applied, without the param group's multiplier."""
        return float(self.applied_lr) / self.state.optimizer.param_groups[0].get("lr_mult", 1.0)
