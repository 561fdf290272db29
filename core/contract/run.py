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
    """State shared with monitors. Monitors read it and may call :meth:`request_stop`; each field
    below is part of the contract. ``state`` holds values saved in checkpoints (train state such as
    ``best_val_loss``); a monitor may add JSON values under a key of its own, back after a resume.
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
        """End the run at the next step boundary, saving a checkpoint first if ``checkpoint``.

        The process then exits with ``exit_code``. The first request wins; a
        request without a checkpoint overrides one with.
        """
        if self.stop is None or (self.stop.checkpoint and not checkpoint):
            self.stop = StopRequest(reason, checkpoint, source, exit_code)
