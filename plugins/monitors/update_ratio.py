"""``update_ratio``: ||update|| / ||parameters|| per parameter group, on log steps.

Before the optimizer steps on a log step (a step pre-hook on
``run.optimizer``), the parameters are copied; at the log step the ratio of
the change to the old norm is reported per group, as
``update_ratio/<group>`` (the core's groups are ``matrix``, ``embedding``,
``norm`` and ``bias``). The copy costs one parameter-sized buffer on log
steps only. Sharded (DTensor) parameters give the local shard's ratio,
which tracks the global one closely for evenly sharded weights. A step
whose update was skipped reports nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from core.api import NoOptions, hookimpl


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


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
            self.saved = [(g.get("name", str(i)), [_local(p).detach().clone() for p in g["params"]]) for i, g in enumerate(optimizer.param_groups)]

    @hookimpl
    def plait_metrics(self, run: Any) -> dict[str, float]:
        saved, self.saved = self.saved, None
        if saved is None:
            return {}
        out = {}
        with torch.no_grad():
            for (name, old), group in zip(saved, run.optimizer.param_groups):
                new = [_local(p).detach() for p in group["params"]]
                if not new:
                    continue
                change = torch.stack([((n.float() - o.float()) ** 2).sum() for n, o in zip(new, old)]).sum().sqrt()
                norm = torch.stack([(o.float() ** 2).sum() for o in old]).sum().sqrt()
                out[f"update_ratio/{name}"] = float(change / norm.clamp(min=1e-12))
        return out

    @hookimpl
    def plait_train_end(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
