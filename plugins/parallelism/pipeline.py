"""Pipeline parallelism for ``fsdp2``'s ``pp`` degree, through ``torch.distributed.pipelining``.

The model spec splits the model into stages (``pipeline_stages``); each rank runs its stages as
``PipelineStage`` objects over the mesh's ``pp`` dimension, and a torch schedule (``1F1B``,
``GPipe``, or ``Interleaved1F1B`` with two stages per rank: rank r holds stages r and r + pp) runs a
step's micro-batches; a stage is given each micro-batch's ``tokens``, ``labels`` and ``micro_batch`` (its
index in the step, a one-element tensor). The micro-batches are the step's gradient-accumulation micro-batches: they are
concatenated and the schedule splits them again, each stage's gradients divided by their count, so
the gradients are those of the step's mean loss, as without pipelining. The last stage's mean loss
is broadcast over the ``pp`` group, so every rank reports it. The gradient norm is the norm over
every stage: each stage's squared norm summed over the ``pp`` group (torchtitan's way).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from core.api import ConfigError
from plugins.parallelism.common import by_mesh, clip_to_norm, grad_norm

SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe")


def stages_per_rank(schedule: str) -> int:
    """Interleaved 1F1B holds two (virtual) stages per rank; the others one."""
    return 2 if schedule == "Interleaved1F1B" else 1


def check_micro_batches(schedule: str, pp: int, micro_batches: int) -> None:
    """Interleaved 1F1B runs its micro-batches in rounds of ``pp``: a multiple of ``pp`` (torch asks
    ``m % max(1, m // pp) == 0``; a multiple always passes)."""
    if schedule == "Interleaved1F1B" and micro_batches % pp:
        raise ConfigError(
            f"[parallelism] fsdp2: pipeline_schedule = 'Interleaved1F1B' with pp = {pp} runs micro-batches in rounds of {pp}, "
            f"but a step has {micro_batches}; expected a multiple of {pp}"
        )


def _stage_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage returns the micro-batch's mean loss itself (the model's own loss, chunked or not)."""
    return output


class Pipeline:
    """This rank's stages of the model and the schedule that runs a step through them."""

    def __init__(self, stages: list[nn.Module], stage_ids: list[int], n_stages: int, schedule: str, pp_mesh: Any, device: torch.device) -> None:
        self.modules, self.stage_ids, self.schedule_name, self.n_stages, self.device = stages, stage_ids, schedule, n_stages, device
        self.group = pp_mesh.get_group()
        self.pp = pp_mesh.size()
        self.has_last = n_stages - 1 in stage_ids
        self.schedule: Any = None
        self.shape: tuple[int, ...] = ()  # (micro-batches, micro-batch, sequence) the schedule was made for

    def make_schedule(self, micro_batches: int) -> Any:
        """The schedule over fresh ``PipelineStage`` objects: a stage infers the shapes it sends and
        receives on its first step, so a new micro-batch shape (a sequence-length stage) needs new ones."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        stages: list[Any] = [PipelineStage(m, s, self.n_stages, self.device, group=self.group) for m, s in zip(self.modules, self.stage_ids)]
        if self.schedule_name == "Interleaved1F1B":
            return ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=_stage_loss)
        kind = Schedule1F1B if self.schedule_name == "1F1B" else ScheduleGPipe
        return kind(stages[0], micro_batches, loss_fn=_stage_loss)

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], tensor_parallel: bool) -> torch.Tensor:
        """Forward and backward of the step's micro-batches; the mean loss, on every rank of the pipeline."""
        shape = (len(micro_batches), *micro_batches[0][0].shape)
        if self.schedule is None or shape != self.shape:
            self.schedule, self.shape = self.make_schedule(len(micro_batches)), shape
        tokens = torch.cat([inputs for inputs, _ in micro_batches])
        labels = torch.cat([lab for _, lab in micro_batches])
        losses: list[torch.Tensor] = []
        context: Any = contextlib.nullcontext()
        if tensor_parallel:  # the head's loss on the vocabulary-sharded logits, forward and backward
            from torch.distributed.tensor.parallel import loss_parallel

            context = loss_parallel()
        with context:
            # each stage is told the index of the micro-batch it runs (split with the tokens): the schedule's
            # first step runs every stage once more on placeholders to infer shapes, a model's records of it
            # are replaced by those of micro-batch 0
            micro_batch = torch.arange(len(micro_batches), device=tokens.device)
            self.schedule.step(target=labels, losses=losses, return_outputs=False, tokens=tokens, labels=labels, micro_batch=micro_batch)
        device = tokens.device
        loss = torch.stack([x.detach().float() for x in losses]).mean() if self.has_last else torch.zeros((), device=device)
        tdist.broadcast(loss, group=self.group, group_src=self.pp - 1)  # the last stage's rank in the pp group
        return loss

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The gradient norm over every stage (each rank's squared norm summed over ``pp``), clipped
        when ``max_norm > 0``."""
        groups = by_mesh(list(model.parameters()))  # DTensor gradients under FSDP / TP / EP: per mesh, then together
        norm = grad_norm(groups).float() ** 2
        tdist.all_reduce(norm, op=tdist.ReduceOp.SUM, group=self.group)
        norm = norm.sqrt()
        if max_norm > 0:
            clip_to_norm(groups, max_norm, norm)
        return norm


def pipeline_stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages rank ``pp_rank`` holds: its own, and with interleaving also ``pp_rank + pp``."""
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule))]
