"""``step_decay``: the learning rate multiplied by ``gamma`` every ``every`` steps."""

from __future__ import annotations

from dataclasses import dataclass

from core.api import option


@dataclass
class StepDecayOptions:
    every: int = option(10, "steps between decays", gt=0)
    gamma: float = option(0.5, "multiplier applied at each decay", gt=0, le=1)


class StepDecay:
    def __init__(self, options: StepDecayOptions) -> None:
        self.options = options

    def multiplier(self, step: int, total_steps: int) -> float:
        return self.options.gamma ** (step // self.options.every)
