"""Calling the monitors' run-event hooks, and checking a monitor before the run starts.

Monitors are pluggy plugins whose ``@hookimpl`` methods implement the run
events of :mod:`core.contract.hookspecs`. :func:`register_monitor` holds each one to
that contract before anything expensive happens: every ``plait_*`` method is
a known run-event hook, carries ``@hookimpl``, asks only for arguments the
hook passes, and is a plain call (run events are notifications; a
``wrapper``/``hookwrapper`` would never run its body here).
"""

from __future__ import annotations

import difflib
import inspect
import sys
from typing import Any

import pluggy

from core.contract import log
from core.contract.errors import PluginError
from core.contract.hookspecs import PROJECT, RUN_EVENT_HOOKS
from core.contract.registry import plugin_manager
from core.data.indexed import check_replacement_batch
from core.runtime import watchdog
from core.runtime.monitor_reductions import reduce_monitor_values


def register_monitor(pm: pluggy.PluginManager, name: str, obj: Any) -> None:
    """Register monitor ``obj`` as ``name`` on ``pm``, or raise PluginError naming what is wrong."""
    marker = PROJECT + "_impl"  # set by core.contract.hookspecs.hookimpl
    for attr in dir(type(obj)):
        if not attr.startswith("plait_"):
            continue
        method = getattr(obj, attr, None)
        if not callable(method):
            continue
        opts = getattr(method, marker, None)
        if attr not in RUN_EVENT_HOOKS:
            close = difflib.get_close_matches(attr, RUN_EVENT_HOOKS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PluginError(f"monitor {name!r}: {attr!r} is not a run-event hook{hint}; the hooks are {', '.join(RUN_EVENT_HOOKS)}")
        if opts is None:
            raise PluginError(f"monitor {name!r}: {attr} lacks @hookimpl (from core.contract.hookspecs import hookimpl), so it would never be called")
        if opts.get("wrapper") or opts.get("hookwrapper"):
            raise PluginError(f"monitor {name!r}: {attr} is a wrapper hook; run-event hooks are plain calls")
        spec_args = set(inspect.signature(getattr(sys.modules["core.contract.hookspecs"], attr)).parameters)
        args = [a for a in inspect.signature(method).parameters]
        unknown = [a for a in args if a not in spec_args]
        if unknown:
            raise PluginError(f"monitor {name!r}: {attr}({', '.join(args)}) asks for {unknown[0]!r}; the hook passes {', '.join(sorted(spec_args))}")
    try:
        pm.register(obj, name=name)
    except (pluggy.PluginValidationError, ValueError) as e:
        raise PluginError(f"monitor {name!r}: {e}") from None


class MonitorHub:
    """Calls run-event hooks on each enabled monitor in config order, naming the one that fails."""

    def __init__(self, monitors: list[tuple[str, Any]], on_error: str = "stop", vocab_size: int | None = None) -> None:
        self.pm = plugin_manager()
        self.vocab_size = vocab_size  # replacement batches are held to it
        self.names = []
        self.on_error = on_error
        self.failed: dict[str, str] = {}  # disabled monitors and why
        for name, obj in monitors:
            register_monitor(self.pm, name, obj)
            self.names.append(name)

    def emit(self, hook: str, **kwargs: Any) -> list[Any]:
        """Call ``hook`` on each monitor that implements it, in config order; their results."""
        assert hook in RUN_EVENT_HOOKS
        impls = {impl.plugin_name: impl for impl in getattr(self.pm.hook, hook).get_hookimpls()}
        return [self._call(name, impls[name], hook, kwargs) for name in self.names if name in impls and name not in self.failed]

    def metrics(self, run: Any, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """``metrics`` with what each monitor's ``plait_metrics`` adds, merged in config order (a monitor
        sees what the ones before it added), then its ``Reduced`` values reduced over the ranks."""
        impls = {impl.plugin_name: impl for impl in self.pm.hook.plait_metrics.get_hookimpls()}
        for name in self.names:
            if name in impls and name not in self.failed:
                extra = self._call(name, impls[name], "plait_metrics", {"run": run, "step": step, "metrics": dict(metrics)})
                if extra:
                    metrics = {**metrics, **extra}
        return reduce_monitor_values(metrics, run.dist)  # on every rank, whatever failed (core.runtime.monitor_reductions)

    def _call(self, name: str, impl: Any, hook: str, kwargs: dict[str, Any]) -> Any:
        """One monitor's hook; a failure disables the monitor and, under ``on_error = "stop"``, stops the run."""
        watchdog.progress(f"in monitor {name!r}'s {hook}")
        try:
            result = impl.function(**{k: kwargs[k] for k in impl.argnames})
            if hook == "plait_metrics" and not isinstance(result, (dict, type(None))):
                raise TypeError(f"returned a {type(result).__name__}; expected a dict of metrics or None")
            if hook == "plait_before_update" and result not in (None, "skip", "rollback"):
                raise TypeError(f"returned {result!r}; expected None, 'skip' or 'rollback'")
            if hook == "plait_replace_batch" and result is not None:
                check_replacement_batch(result, kwargs["inputs"], kwargs["labels"], self.vocab_size)
            return result
        except Exception as e:
            why = f"monitor {name!r} failed in {hook}: {type(e).__name__}: {e}"
            self.failed[name] = why
            run = kwargs.get("run")
            action = "disabling it and going on" if self.on_error == "continue" else "stopping the run"
            action = "the run has ended; its exit code stands" if hook == "plait_train_end" else action
            on = f"rank {log.rank()}: " if log.rank() else ""  # every rank that fails says so: it may be the only one
            log.error(f"{on}{why}; {action} (monitors.on_error = {self.on_error!r})", all_ranks=True)
            if self.on_error == "stop" and run is not None:
                run.request_stop(why, checkpoint=hook != "plait_train_end", source=name, exit_code=4)
            return None
        finally:
            watchdog.progress(f"after monitor {name!r}'s {hook}")

    def implements(self, hook: str) -> bool:
        return bool(getattr(self.pm.hook, hook).get_hookimpls())
