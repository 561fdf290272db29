"""Monitors are held to the hook contract before a run starts: a good monitor passes, and each breach is
one line naming the monitor."""

from __future__ import annotations

import pytest

from core.config.registry import plugin_manager
from core.contract.errors import PluginError
from core.contract.hookspecs import hookimpl, register_monitor


class Good:
    @hookimpl
    def plait_step_end(self, run, step):  # a subset of the hook's arguments is fine
        pass


class Misspelled:
    @hookimpl
    def plait_step_ends(self, run, step, metrics):
        pass


class WrongArgument:
    @hookimpl
    def plait_step_end(self, run, step_number):
        pass


class Wrapper:
    @hookimpl(wrapper=True)
    def plait_train_start(self, run):
        yield


class Unmarked:
    def plait_train_end(self, run, reason):
        pass


def test_a_good_monitor_passes():
    register_monitor(plugin_manager(), "good", Good())


@pytest.mark.parametrize(
    "monitor, words",
    [
        (Misspelled(), ["'plait_step_ends' is not a run-event hook", "did you mean 'plait_step_end'"]),
        (WrongArgument(), ["asks for 'step_number'", "the hook passes metrics, run, step"]),
        (Wrapper(), ["plait_train_start is a wrapper hook"]),
        (Unmarked(), ["plait_train_end lacks @hookimpl"]),
    ],
)
def test_contract_breaches_are_one_line_errors_naming_the_monitor(monitor, words):
    with pytest.raises(PluginError) as e:
        register_monitor(plugin_manager(), "mine", monitor)
    message = str(e.value)
    assert "\n" not in message and message.startswith("monitor 'mine':")
    for w in words:
        assert w in message, message
