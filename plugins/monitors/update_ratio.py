"""``update_ratio``: ||update|| / ||parameters|| per parameter group, on log steps.

Before the optimizer steps on a log step (a step pre-hook on
``run.optimizer``), the parameters are copied; at the log step the ratio of
the change to the old norm is reported per group, as
``update_ratio/<group>`` (the core's groups are ``matrix``, ``embedding``,
``norm`` and ``bias``). The copy costs one parameter-sized buffer on log
steps only (each rank its own shard, DTensors kept as they are). The ratio is the whole model's under
every parallelism: each rank's shares of the squared change and squared
weights (``core.api.squared_norm_share``), summed over the ranks by the core
(``core.api.Reduced``) before the ratio is taken. A step whose update was skipped reports
nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from core.api import NoOptions, Reduced, hookimpl, squared_norm_share


def _ratio(sums: torch.Tensor) -> float:
    """sqrt(squared change / squared weights), both summed over the ranks."""
    return float(sums[0].sqrt() / sums[1].sqrt().clamp(min=1e-12))


class UpdateRatio:
    def __init__(self, options: NoOptions) -> None:
        self.saved: list[tuple[str, list[torch.Tensor]]] | None = None
        self.handle: Any = None

    @hookimpl
    def plait_train_start(self, run: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.handle = run.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self.before(run, optimizer))

    @torch.no_grad()
    def before(self, run: Any, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer is about to step: copy the parameters if this step will be logged."""
        if run.is_log_step(run.step + 1):
            self.saved = [(g.get("name", str(i)), [p.detach().clone() for p in g["params"]]) for i, g in enumerate(optimizer.param_groups)]

    @hookimpl
    def plait_metrics(self, run: Any) -> dict[str, Reduced]:
        saved, self.saved = self.saved, None
        if saved is None:
            return {}
        out = {}
        with torch.no_grad():
            for (name, old), group in zip(saved, run.optimizer.param_groups):
                if not group["params"]:
                    continue
                world = run.dist.world_size
                change = torch.stack([squared_norm_share(p.detach().float() - o.float(), world) for p, o in zip(group["params"], old)]).sum()
                norm = torch.stack([squared_norm_share(o, world) for o in old]).sum()
                out[f"update_ratio/{name}"] = Reduced("sum", torch.stack([change, norm]), finish=_ratio)
        return out

    @hookimpl
    def plait_train_end(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
