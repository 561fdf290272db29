"""The object that run-event hooks receive: where the run is, and a way to stop it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.protocols import DistInfo


@dataclass
class StopRequest:
    reason: str
    checkpoint: bool
    source: str = ""
    exit_code: int = 0


@dataclass
class Run:
    """State shared with monitors. Monitors read it and may call :meth:`request_stop`.

    ``config`` is the resolved config (plain dict, as written to
    ``<output_dir>/config.resolved.toml``); ``state`` holds values that are
    saved in checkpoints (train state such as ``best_val_loss``); monitors may
    add their own keys under a name of their own.
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
    state: dict[str, Any] = field(default_factory=dict)
    stop: StopRequest | None = None
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
