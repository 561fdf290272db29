"""What the gloo worker scripts beside it share (imported from their folder, first on ``sys.path``): a
small model whose rank-0 rows under fsdp2 are 50x larger than rank 1's, wrapped as a run wraps it, and a
rank's life: the process group, the script's results as JSON in ``argv[1]`` with the rank appended, and
the exit core.train takes."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import NoReturn

import torch
from torch import nn

from core.contract.protocols import DistInfo
from core.runtime import distributed


def build_model() -> nn.Module:
    """Linear(8, 16) then Linear(16, 8), seeded; the first matrix's rows 0-7 (rank 0's under fsdp2 over 2 ranks) times 50."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    with torch.no_grad():
        model[0].weight[:8] *= 50  # the rows rank 0 holds under fsdp2
    return model


def wrap(parallelism, model: nn.Module, info: DistInfo) -> nn.Module:
    """``model`` (from build_model) wrapped by a parallelism plugin's object, each Linear a block, in its own dtype."""
    return parallelism.wrap(model, SimpleNamespace(blocks=lambda m: [m[0], m[1]]), info, SimpleNamespace(param_dtype=None))


def run_rank(results: Callable[[DistInfo], dict]) -> NoReturn:
    """This rank joins the gloo group, writes ``results(info)`` as JSON to ``argv[1].<rank>``, and leaves."""
    info = distributed.init("cpu")
    out = results(info)
    with open(f"{sys.argv[1]}.{info.rank}", "w") as f:
        json.dump(out, f)
    distributed.shutdown()
    os._exit(0)  # as core.train leaves: interpreter finalization can abort a finished gloo rank (core/cli/train.py)
