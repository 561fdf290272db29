"""A monitor's ``plait_before_update`` sees the gradients already clipped, and gets the factor clipping
applied (``clip_coef``) beside the norm before clipping (``grad_norm``); a monitor written before
``clip_coef`` existed (taking ``run, step, loss, grad_norm``) is still called. Short in-process runs of
the tiny model with real monitors enabled through the config, as a third party's are."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import write_tiny_config

from core.api import hookimpl, squared_norm_share
from core.config import registry as registry_mod
from core.contract.protocols import DistInfo
from core.loop.trainer import Trainer
from core.preflight.prepare import prepare

pytestmark = pytest.mark.usefixtures("one_thread")

SEEN: dict[str, list[tuple]] = {"clip_watch": [], "old_style": []}


class ClipWatch:
    """Records, before each update, the hook's arguments and the gradients' global norm as they are now."""

    def __init__(self, options):
        pass

    @hookimpl
    def plait_before_update(self, run, step, grad_norm, clip_coef):
        grads = [p.grad for p in run.model.parameters() if p.grad is not None]
        now = math.sqrt(float(sum(squared_norm_share(g, run.dist.world_size) for g in grads)))
        SEEN["clip_watch"].append((step, grad_norm, clip_coef, now))


class OldStyle:
    """A monitor of the hook's earlier arguments only."""

    def __init__(self, options):
        pass

    @hookimpl
    def plait_before_update(self, run, step, loss, grad_norm):
        SEEN["old_style"].append((step, grad_norm))


@pytest.fixture
def monitors():
    reg = registry_mod.load()
    reg._plugin, reg._distribution = "clip_test", "clip-test"
    reg.add("monitor", "clip_watch", ClipWatch, doc="records the gradients' norm before each update")
    reg.add("monitor", "old_style", OldStyle, doc="takes the hook's first four arguments")
    for seen in SEEN.values():
        seen.clear()
    yield
    for name in SEEN:
        del reg._components["monitor"][name]


def run(tmp_path, grad_clip: float) -> None:
    cfg = write_tiny_config(tmp_path, steps=3)
    over = [f"--train.grad_clip={grad_clip}", '--monitors.enabled=["clip_watch", "old_style"]', "--checkpoint.every=0", "--checkpoint.at_end=false"]
    trainer = Trainer(prepare(str(cfg), over), DistInfo(device=torch.device("cpu")))
    trainer.build()
    assert trainer.fit() == 0


def test_gradients_at_before_update_are_clipped_by_clip_coef(monitors, tmp_path):
    run(tmp_path, grad_clip=0.05)  # far below the tiny model's first gradient norms: every step is clipped
    assert [s for s, *_ in SEEN["clip_watch"]] == [1, 2, 3]
    for step, grad_norm, clip_coef, now in SEEN["clip_watch"]:
        assert grad_norm > 0.5, grad_norm  # the norm before clipping
        assert clip_coef == pytest.approx(0.05 / (grad_norm + 1e-6)) and clip_coef < 0.1
        assert now == pytest.approx(0.05, rel=1e-3) == pytest.approx(grad_norm * clip_coef, rel=1e-3)  # already clipped
    assert SEEN["old_style"] == [(s, g) for s, g, _, _ in SEEN["clip_watch"]]


def test_without_clipping_clip_coef_is_one(monitors, tmp_path):
    run(tmp_path, grad_clip=0.0)
    assert len(SEEN["clip_watch"]) == 3
    for step, grad_norm, clip_coef, now in SEEN["clip_watch"]:
        assert clip_coef == 1.0 and now == pytest.approx(grad_norm, rel=1e-4)
