"""Calling the monitors' run-event hooks, and checking a monitor before the run starts.

Monitors are pluggy plugins whose ``@hookimpl`` methods implement the run
events of :mod:`core.contract.hookspecs`. :func:`core.contract.hookspecs.register_monitor` holds each one to
that contract before anything expensive happens: every ``plait_*`` method is
a known run-event hook, carries ``@hookimpl``, asks only for arguments the
hook passes, and is a plain call (run events are notifications; a
``wrapper``/``hookwrapper`` would never run its body here).
"""

from __future__ import annotations

from typing import Any

from core.config.registry import plugin_manager
from core.contract import log
from core.contract.hookspecs import RUN_EVENT_HOOKS, register_monitor
from core.data.indexed import check_replacement_batch
from core.runtime import watchdog
from core.runtime.monitor_reductions import reduce_monitor_values


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
