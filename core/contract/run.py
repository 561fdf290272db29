"""The object that run-event hooks receive: where the run is, and a way to stop it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.contract.protocols import DistInfo


@dataclass
class StopRequest:
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
      in place; not the parallelism's wrapper); ``spec``: the model spec; ``optimizer``: the torch
      optimizer the optimizer plugin built;
    * ``state``: the train state saved in every checkpoint (``best_val_loss``, ...). A monitor may
      keep JSON values under a key of its own: they are back after a resume and after a rollback; a
      value that is not JSON stops the run naming the key;
    * ``stop``: the stop requested so far (``reason``, ``checkpoint``, ``source``, ``exit_code``), or
      ``None``; ``log_every``: ``train.log_every`` (:meth:`is_log_step`).
    """

    config: dict[str, Any]  # the resolved config, as written to <output_dir>/config.resolved.toml
    output_dir: Path  # train.output_dir
    dist: DistInfo  # this process: rank, world size, device
    total_steps: int  # the step the run ends at
    tokens_per_step: int  # tokens of one optimizer step, all ranks together
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0  # tokens trained on so far, resumes included
    model: Any = None  # the model spec's module, converted by the precision (under fsdp2, sharded in place)
    spec: Any = None  # the model spec (core.contract.protocols.ModelSpec)
    optimizer: Any = None  # the torch optimizer the optimizer plugin built
    precision: Any = None  # the precision plugin's object: ``run.precision.autocast(run.dist.device)`` around a forward
    tokenizer: dict[str, Any] | None = None  # the data source's declared tokenizer (``spec``, ``eos_id``, ``fingerprint``), None if none
    state: dict[str, Any] = field(default_factory=dict)
    stop: StopRequest | None = None  # the stop requested so far (reason, checkpoint, exit code), if any
    log_every: int = 1  # train.log_every

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
