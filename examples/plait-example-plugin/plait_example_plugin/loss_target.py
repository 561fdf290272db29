"""A monitor that ends the run once the loss reaches a target."""

from __future__ import annotations

from dataclasses import dataclass

from core.api import hookimpl, option


@dataclass
class LossTargetOptions:
    target: float = option(0.0, "stop once the logged training loss is below this value")
    checkpoint: bool = option(True, "save a checkpoint before stopping")


class LossTarget:
    def __init__(self, options: LossTargetOptions) -> None:
        self.options = options

    @hookimpl
    def plait_step_end(self, run, step, metrics):
        loss = metrics.get("loss")
        if loss is not None and loss < self.options.target:
            run.request_stop(f"loss {loss:.4f} < target {self.options.target}", checkpoint=self.options.checkpoint, source="loss_target")
