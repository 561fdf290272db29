"""The plugin contract as a third-party author meets it, in this process: an option type or name no config
could set is refused when the plugin registers, options ``options.toml`` can set still register, and a
monitor that fails in ``plait_train_end`` is not said to stop the run."""

from __future__ import annotations

import enum
import pathlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from core.config import registry as registry_mod
from core.contract.errors import PluginError
from core.contract.options import option


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


def test_a_monitor_that_fails_in_train_end_is_not_said_to_stop_the_run(capsys):
    """A monitor failing at ``plait_train_end``, when the run is over, is one line saying the run has ended and
    its exit code stands."""
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
