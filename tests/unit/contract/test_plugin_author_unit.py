"""What a third-party plugin author met relying on the documented contract alone, each now held:
monitors' verdicts and failures on one rank of several, a stream's per-rank position resumed on
another world size (core.plan said nothing), plugins that exit at import, option types and names no
config could set, and a monitor's non-JSON ``run.state`` value. Real entry points (a distribution
on PYTHONPATH), real processes, two ranks under torchrun where ranks matter."""

from __future__ import annotations

import enum
import pathlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from core.config import registry as registry_mod
from core.contract.errors import PluginError
from core.contract.options import option

# A monitor whose verdict and failure depend on the rank: rank 1 alone skips step 2's update and
# raises in step 3's plait_step_end, after writing what its rank's weights sum to.
SPLIT = """
import json, os
from core.api import hookimpl

class Split:
    def __init__(self, options):
        pass

    @hookimpl
    def plait_before_update(self, run, step):
        return "skip" if run.dist.rank == 1 and step == 2 else None

    @hookimpl
    def plait_step_end(self, run, step):
        if step == 3:
            total = sum(float(p.detach().double().sum()) for p in run.model.parameters())
            with open(os.path.join(run.output_dir, f"weights_{run.dist.rank}.json"), "w") as f:
                json.dump(total, f)
            if run.dist.rank == 1:
                raise RuntimeError("rank 1's sensor broke")

@hookimpl
def plait_register(registry):
    registry.add("monitor", "split", Split, doc="decides and fails on rank 1 alone")
"""


# A stream whose loader keeps a position per rank (``per_rank_state``) and declares no check_resume.
STREAM = """
import torch
from core.api import hookimpl, log

class Loader:
    per_rank_state = True
    may_end = True

    def __init__(self, spec):
        self.spec, self.n = spec, 0

    def __iter__(self):
        while True:
            s = self.spec
            ids = (torch.arange(s.micro_batch * (s.seq_len + 1)).view(s.micro_batch, -1) + self.n + s.dp_rank) % 50
            self.n += 1
            yield ids[:, :-1], ids[:, 1:]

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]

class Counting:
    def __init__(self, options):
        pass

    def validate(self, vocab_size, seq_len):
        pass

    def loader(self, spec):
        log.info(f"counting: loader for rank {spec.dp_rank}", all_ranks=True)
        return Loader(spec)

@hookimpl
def plait_register(registry):
    registry.add("data", "counting", Counting, doc="a per-rank stream of counting ids")
"""


class Color(enum.Enum):
    RED = "red"


def options_with(**fields):
    """An options dataclass with one field per keyword: name=(annotation, default, doc)."""
    ns = {"__annotations__": {name: tp for name, (tp, _, _) in fields.items()}}
    ns.update({name: option(default, doc) for name, (_, default, doc) in fields.items()})
    return dataclass(type("O", (), ns))


@pytest.mark.parametrize(
    "slot, name, fields, expected",
    [
        ("lr_schedule", "s", {"path": (pathlib.Path, pathlib.Path("a.txt"), "a file")}, "option 'path' is a Path, which no TOML value is"),
        ("lr_schedule", "s", {"color": (Color, Color.RED, "a colour")}, "option 'color' is a Color, which no TOML value is"),
        ("lr_schedule", "s", {"by_step": (dict[int, float], {1: 0.5}, "per step")}, "option 'by_step' is a dict[int, float], which no TOML value is"),
        ("lr_schedule", "s", {"x": (int, 1, "first line\nsecond line")}, "the doc of 'x' spans more than one line"),
        ("data", "d", {"seq_len": (int, 64, "my window")}, "option 'seq_len' is a key the core reads in [data] itself"),
        ("optimizer", "o", {"name": (str, "x", "a label")}, "option 'name' is a key the core reads in [optimizer] itself"),
        ("precision", "p", {"fallback": (bool, False, "mine")}, "option 'fallback' is a key the core reads in [precision] itself"),
        ("monitor", "on_error", {}, "the name 'on_error' is a key the core reads in [monitors]"),
        ("precision", "fallback", {}, "the name 'fallback' is a key the core reads in [precision]"),
        ("monitor", "my.monitor", {}, "the name 'my.monitor' is not a bare TOML key"),
    ],
)
def test_an_option_or_name_no_config_could_set_is_refused_when_it_registers(slot, name, fields, expected):
    """These registered, and ``python -m core.plugins`` listed them as options, yet no config could
    set them: a Path or an Enum (TOML gives a string: "expected Path, got str"; a Path default was a
    TypeError traceback when the run wrote its resolved config), a dict with int keys, an option the
    core takes for itself (the plugin always got its default), a monitor named like a [monitors] key,
    a dotted name (``--monitors.my.monitor.x`` splits it). A doc of two lines broke the listing."""
    reg = registry_mod.Registry()
    reg._plugin, reg._distribution = "author", "author-plugin"
    with pytest.raises(PluginError) as err:
        reg.add(slot, name, object, options=options_with(**fields), doc="d")
    assert str(err.value).startswith("plugin 'author' (distribution author-plugin): ") and expected in str(err.value), str(err.value)


def test_options_toml_can_set_still_register():
    reg = registry_mod.Registry()
    fields = {
        "maybe": (float | None, None, "left out: None"),
        "pair": (tuple[float, float], (0.9, 0.99), "two numbers"),
        "by_name": (dict[str, list[int]], {"a": [1]}, "lists by name"),
        "mode": (__import__("typing").Literal["a", "b"], "a", "a choice"),
    }
    reg.add("lr_schedule", "fine-name_1", object, options=options_with(**fields), doc="d")
    assert reg.names("lr_schedule") == ["fine-name_1"]


KEEPS_A_SET = """
import json, os
from core.api import hookimpl

class KeepsASet:
    def __init__(self, options):
        pass

    @hookimpl
    def plait_step_end(self, run, step):
        run.state["seen"] = {"steps": {step}}

    @hookimpl
    def plait_train_end(self, run, reason):
        with open(os.path.join(run.output_dir, "train_end.json"), "w") as f:
            json.dump(reason, f)

@hookimpl
def plait_register(registry):
    registry.add("monitor", "keeps_a_set", KeepsASet, doc="keeps a set in run.state")
"""


def test_a_monitor_that_fails_in_train_end_is_not_said_to_stop_the_run(capsys):
    """At ``plait_train_end`` the run is over; the line said "stopping the run" all the same."""
    from core.contract.hookspecs import hookimpl
    from core.contract.protocols import DistInfo
    from core.contract.run import Run
    from core.loop.monitor_hub import MonitorHub

    class Late:
        @hookimpl
        def plait_train_end(self, run, reason):
            raise OSError("upload failed")

    run = Run(config={}, output_dir=Path("."), dist=DistInfo(), total_steps=1, tokens_per_step=1)
    MonitorHub([("late", Late())]).emit("plait_train_end", run=run, reason="completed")
    err = capsys.readouterr().err
    assert "monitor 'late' failed in plait_train_end: OSError: upload failed; the run has ended; its exit code stands" in err, err


HF_HABIT = """
import torch.nn.functional as F
from torch import nn
from core.api import hookimpl

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.blocks, self.head = nn.Embedding(512, 16), nn.ModuleList([nn.Linear(16, 16)]), nn.Linear(16, 512)

    def forward(self, ids, labels=None):
        logits = self.head(self.blocks[0](self.emb(ids)))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits  # the Hugging Face habit

class Spec:
    vocab_size = 512

    def __init__(self, options):
        pass

    def build(self):
        return Net()

    def init_weights(self, model):
        for p in model.parameters():
            nn.init.normal_(p, std=0.02)

    def blocks(self, model):
        return list(model.blocks)

    def flops_per_token(self, seq_len):
        return 6.0 * 16 * 1024

    def activation_bytes(self, micro_batch, seq_len, bytes_per_element):
        return micro_batch * seq_len * 1024 * bytes_per_element

@hookimpl
def plait_register(registry):
    registry.add("model", "hf_habit", Spec, doc="forward returns (loss, logits)")
"""
