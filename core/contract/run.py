"""What monitors receive: :class:`PreparedRun` before the run starts (``plait_preflight``), then
:class:`Run` in every run-event hook (where the run is, and a way to stop it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from core.contract.protocols import DistInfo, ModelSpec


@dataclass(frozen=True)
class PreparedRun:
    """What ``plait_preflight(prep, force)`` receives as ``prep``: the run as planned and checked, before
    any process group or model exists (``core.train`` on every rank, and ``core.plan``).

    * ``world_size``: the ranks of the run (``core.plan``: its ``--nproc``);
    * ``device``: this rank's device;
    * ``grad_accum``: micro-batches per optimizer step on each rank;
    * ``tokens_per_step``: tokens of one optimizer step, all ranks together (``train.global_batch_tokens``);
    * ``total_steps``: the run's length as the config gives it (``train.steps``, or ``train.target_tokens``
      over ``tokens_per_step``); a resume of a ``target_tokens`` run at another batch size ends elsewhere;
    * ``resolved``: the resolved config as a dict, as ``run.config`` will hold it;
    * ``spec``: the model spec (:class:`ModelSpec`), its module not built;
    * ``tokenizer``: the data source's declared tokenizer, as ``run.tokenizer`` will hold it (None if none).

    Which checkpoint a resume starts from is not known yet: the run's folders are checked after this hook.
    """

    world_size: int
    device: torch.device
    grad_accum: int
    tokens_per_step: int
    total_steps: int
    resolved: dict[str, Any]
    spec: ModelSpec
    tokenizer: dict[str, Any] | None


@dataclass
class StopRequest:
    """A stop asked for with :meth:`Run.request_stop` (its arguments, as given)."""

    reason: str
    checkpoint: bool
    source: str = ""
    exit_code: int = 0


@dataclass
class Run:
    """What run-event hooks receive: where the run is, and :meth:`request_stop`.

    Monitors read it and may call :meth:`request_stop`; every field is part of the contract:

    * ``config``: the resolved config as a dict, as written to ``<output_dir>/config.resolved.toml``;
    * ``output_dir``: ``train.output_dir``, a :class:`pathlib.Path`;
    * ``dist``: this process's :class:`DistInfo` (rank, world size, local rank, device);
    * ``total_steps``: the step the run ends at; ``tokens_per_step``: tokens of one optimizer step,
      all ranks together;
    * ``step``: optimizer steps completed (0 before the first; a hook's ``step`` argument is the
      1-based number of the step it is about); ``tokens_seen``: tokens trained so far, resumes
      included;
    * ``model``: the module the model spec built, converted by the precision (under fsdp2, sharded
      in place: its parameters are DTensors; not the parallelism's wrapper); ``spec``: the model spec
      (:class:`ModelSpec`); ``optimizer``: the torch optimizer the optimizer plugin built;
      ``precision``: the precision plugin's object (``run.precision.autocast(run.dist.device)``
      around a forward of a monitor's own);
    * ``tokenizer``: the data source's declared tokenizer (``spec``, ``eos_id``, ``fingerprint``),
      None if it declares none;
    * ``state``: the train state saved in every checkpoint and restored on a resume or rollback. The
      core's keys (read them, never write them): ``lineage`` (this run's id, hex text made at a fresh
      start and kept through every resume), ``wall_time_s`` (seconds of training, all attempts
      together, saves included; a rollback keeps it), ``best_val_loss`` (the lowest ``val_loss`` so
      far; ``inf`` before the first validation) and ``best_checkpoints`` (``checkpoint.keep_best``'s
      ranking, ``[[value, step], ...]`` best first, the value negated for ``best_mode = "max"``). A
      monitor may keep JSON values under a key of its own: they are back after a resume and after a
      rollback; a value that is not JSON stops the run naming the key;
    * ``stop``: the stop requested so far (``reason``, ``checkpoint``, ``source``, ``exit_code``), or
      ``None``; ``log_every``: ``train.log_every`` (:meth:`is_log_step`);
    * ``stop_signalled``: ``run.stop_signalled()`` is True once a stop signal (SIGTERM, SIGINT, SIGHUP) has
      reached any rank. It is a collective: every rank calls it at the same point, as between the batches
      of a long pass of a monitor's own (the ``downstream`` evaluation), which then ends the pass early;
      the run stops at the next step boundary with a checkpoint, within a pre-emption's grace period.
    """

    config: dict[str, Any]
    output_dir: Path
    dist: DistInfo
    total_steps: int
    tokens_per_step: int
    step: int = 0
    tokens_seen: int = 0
    model: Any = None
    spec: Any = None
    optimizer: Any = None
    precision: Any = None
    tokenizer: dict[str, Any] | None = None
    state: dict[str, Any] = field(default_factory=dict)
    stop: StopRequest | None = None
    log_every: int = 1
    stop_signalled: Callable[[], bool] = field(default=lambda: False, repr=False)

    def is_log_step(self, step: int) -> bool:
        """Are metrics logged after ``step`` (1-based)? Every ``train.log_every`` steps, and the last."""
        return step % self.log_every == 0 or step == self.total_steps

    def request_stop(self, reason: str, checkpoint: bool = True, source: str = "", exit_code: int = 0) -> None:
        """End the run at the next step boundary, on every rank, saving a checkpoint first if ``checkpoint``.

        ``run.request_stop(reason, checkpoint=True, source="", exit_code=0)``: ``reason`` is printed
        (``stopping at step N: <reason>``) and recorded as the ``detail`` of ``exit_status.json``,
        whose reason is ``requested``; ``source`` names who asked (a monitor passes its own name; it
        is kept in :attr:`stop`); the process then exits with ``exit_code``. A request on any rank
        stops every rank at the same step. The first request wins; a request without a checkpoint
        overrides one with.
        """
        if self.stop is None or (self.stop.checkpoint and not checkpoint):
            self.stop = StopRequest(reason, checkpoint, source, exit_code)
