"""Plugin discovery: entry points in the group ``plait``, loaded with pluggy.

Order (as tox does it): plait's own entry points first, then third-party ones
sorted by name, then ``check_pending`` so that a misspelled hook name in a
plugin is an error rather than silently ignored. Set ``PLAIT_PLUGINS`` to a
comma-separated list of entry-point names to load only those third-party
plugins (plait's own always load); an empty value loads none, and a name
that no installed plugin provides is an error.
"""

from __future__ import annotations

import ast
import dataclasses
import linecache
import os
import sys
import textwrap
import traceback
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable

import pluggy

from core.config.sections import clash
from core.contract import hookspecs
from core.contract.errors import ConfigError, PluginError, closest
from core.contract.option_values import unusable_options
from core.contract.options import NoOptions, undocumented
from core.contract.protocols import SLOTS

ENTRY_POINT_GROUP = "plait"
OWN_DISTRIBUTION = "plait"
ALLOW_ENV = "PLAIT_PLUGINS"


@dataclass(frozen=True)
class Component:
    """One named implementation of a slot."""

    slot: str
    name: str
    factory: Callable[[Any], Any]
    options: type
    doc: str
    plugin: str
    distribution: str

    @property
    def provider(self) -> str:
        return f"plugin {self.plugin!r} (distribution {self.distribution})"


class Registry:
    """Components by slot and name; filled through ``plait_register``."""

    def __init__(self) -> None:
        self._components: dict[str, dict[str, Component]] = {s: {} for s in SLOTS}
        self._plugin = "?"
        self._distribution = "?"
        self.hidden: list[str] = []  # installed third-party plugins left out by PLAIT_PLUGINS
        self.third_party: dict[str, str] = {}  # loaded third-party plugin -> "distribution version"

    def add(
        self,
        slot: str,
        name: str,
        factory: Callable[[Any], Any],
        options: type = NoOptions,
        doc: str = "",
    ) -> None:
        """Register ``factory`` as component ``name`` of ``slot``."""
        where = f"plugin {self._plugin!r} (distribution {self._distribution})"
        if not isinstance(name, str) or not name.strip():
            raise PluginError(f"{where} registers a {slot} component named {name!r}: expected a non-empty string")
        if slot not in self._components:
            raise PluginError(f"{where} registers {name!r} for unknown slot {slot!r}; slots: {', '.join(SLOTS)}")
        if not dataclasses.is_dataclass(options):
            raise PluginError(f"{where}: options of {slot} {name!r} must be a dataclass, got {options!r}")
        missing = undocumented(options)
        if missing:
            raise PluginError(f"{where}: options of {slot} {name!r} lack a doc: {', '.join(missing)}")
        why = unusable_options(options)
        if why or (clashes := clash(slot, name, options)):
            raise PluginError(f"{where}: {'options of ' if why else ''}{slot} {name!r}: {why or clashes}")
        existing = self._components[slot].get(name)
        if existing is not None:
            raise PluginError(f"{slot} {name!r} is claimed twice: by {existing.provider} and by {where}")
        self._components[slot][name] = Component(slot, name, factory, options, doc, self._plugin, self._distribution)

    def get(self, slot: str, name: str, where: str) -> Component:
        """The component, or a ConfigError listing the installed names."""
        found = self._components[slot].get(name)
        if found is None:
            names = sorted(self._components[slot])
            hidden = f"; {ALLOW_ENV}={os.environ.get(ALLOW_ENV, '')!r} leaves out the installed plugin(s) {', '.join(self.hidden)}" if self.hidden else ""
            raise ConfigError(f"{where}: no {slot} plugin named {name!r}{closest(name, names)}; installed: {', '.join(names) or '(none)'}{hidden}")
        return found

    def names(self, slot: str) -> list[str]:
        return sorted(self._components[slot])

    def components(self, slot: str) -> list[Component]:
        return [self._components[slot][n] for n in self.names(slot)]


def _entry_points() -> list[tuple[metadata.EntryPoint, str]]:
    """The entry points in the group ``plait``, each with its distribution's name: plait's own first,
    then by distribution and name. Each distribution's name is read once (a read parses its METADATA)."""
    seen: set[tuple[str, str]] = set()
    names: dict[metadata.Distribution, str] = {}
    found = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = (ep.name, ep.value)
        if key in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add(key)
        if ep.dist is not None and ep.dist not in names:
            names[ep.dist] = ep.dist.name
        found.append((ep, names[ep.dist] if ep.dist is not None else "?"))
    return sorted(found, key=lambda pair: (pair[1] != OWN_DISTRIBUTION, pair[1], pair[0].name))


def internal_import_hint(e: BaseException) -> str:
    """For a plugin whose import of a ``core`` module other than ``core.api`` failed (an internal path,
    moved or never public): the ``core.api`` names to import instead, as the end of its one-line
    error; '' for any other failure."""
    module = e.name if isinstance(e, ImportError) else None
    if not module or module.split(".")[0] != "core" or module == "core.api":
        return ""
    # core.api sits above every core package, which never import it; plait's own plugins, loaded
    # before any third-party one, have imported it by now
    exported = set(getattr(sys.modules.get("core.api"), "__all__", ()))
    use = [name for name in imported_names(e) if name in exported]
    if not use:
        return "; plugins import from core.api alone (help(core.api) lists its names)"
    return f"; plugins import from core.api alone: from core.api import {', '.join(use)}"


def imported_names(e: BaseException) -> list[str]:
    """The names the failed import statement asked for (``from core.x import a, b``: a and b;
    ``import core.x.y``: y), read from the innermost frame of the plugin's code."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]
    first = frames[-1].lineno if frames else None
    if first is None:
        return []
    last = frames[-1]
    lines = range(first, (last.end_lineno or first) + 1)
    try:
        tree = ast.parse(textwrap.dedent("".join(linecache.getline(last.filename, n) for n in lines)))
    except SyntaxError:
        return []
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name.rsplit(".", 1)[-1] for alias in node.names]
    return names


def plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


_CACHE: dict[str | None, tuple[Registry, pluggy.PluginManager]] = {}


def load(allow: str | None = None) -> Registry:
    """Load every installed plugin once per process and return the registry."""
    if allow is None:
        allow = os.environ.get(ALLOW_ENV)
    if allow not in _CACHE:
        _CACHE[allow] = _load(allow)
    return _CACHE[allow][0]


def _load(allow: str | None) -> tuple[Registry, pluggy.PluginManager]:
    allowed = None if allow is None else {a.strip() for a in allow.split(",") if a.strip()}
    pm = plugin_manager()
    origin: dict[str, str] = {}
    hidden: list[str] = []
    versions: dict[str, str] = {}
    eps = _entry_points()
    if allowed is not None:
        third = {ep.name for ep, dist in eps if dist != OWN_DISTRIBUTION}
        unknown = sorted(allowed - third)
        if unknown:
            raise PluginError(
                f"{ALLOW_ENV} names {', '.join(map(repr, unknown))}, which no installed third-party plugin provides (plait's own always load); "
                f"installed third-party plugins: {', '.join(sorted(third)) or '(none)'}"
            )
    for ep, dist in eps:
        if dist != OWN_DISTRIBUTION and allowed is not None and ep.name not in allowed:
            hidden.append(ep.name)
            continue
        if dist != OWN_DISTRIBUTION:
            versions[ep.name] = f"{dist} {ep.dist.version if ep.dist is not None else '?'}"
        if pm.has_plugin(ep.name):
            raise PluginError(f"entry point {ep.name!r} is claimed twice: by distribution {origin[ep.name]} and by {dist}")
        try:
            module = ep.load()
        except (Exception, SystemExit) as e:  # any import failure (sys.exit, argparse at import too) is that plugin's problem
            others = ",".join(sorted({o.name for o, o_dist in eps if o_dist != OWN_DISTRIBUTION} - {ep.name})) or "''"
            out = f"; to run without it: {ALLOW_ENV}={others} (the other third-party plugins), or uninstall {dist}" if dist != OWN_DISTRIBUTION else ""
            why = f"{type(e).__name__}: {e}{internal_import_hint(e)}"
            raise PluginError(f"plugin {ep.name!r} (distribution {dist}, {ep.value}) failed to import: {why}{out}") from None
        try:
            pm.register(module, name=ep.name)
        except pluggy.PluginValidationError as e:  # a hook implementation of the wrong shape
            raise PluginError(f"plugin {ep.name!r} (distribution {dist}, {ep.value}): {' '.join(str(e).split())}") from None
        if callable(getattr(module, "plait_register", None)) and not any(i.plugin_name == ep.name for i in pm.hook.plait_register.get_hookimpls()):
            raise PluginError(
                f"plugin {ep.name!r} (distribution {dist}, {ep.value}) defines plait_register without the @hookimpl marker "
                "(from core.api import hookimpl), so plait would never call it"
            )
        origin[ep.name] = dist
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        raise PluginError(f"plugin {e.plugin!r}: {' '.join(str(e).split())}") from None
    registry = Registry()
    registry.hidden, registry.third_party = hidden, versions
    for impl in pm.hook.plait_register.get_hookimpls():  # registration order: plait's own first (pluggy calls in reverse)
        registry._plugin = impl.plugin_name
        registry._distribution = origin.get(impl.plugin_name, "?")
        try:
            impl.function(registry=registry)
        except PluginError:
            raise
        except (Exception, SystemExit) as e:
            raise PluginError(
                f"plugin {impl.plugin_name!r} (distribution {registry._distribution}) failed in plait_register: {type(e).__name__}: {e}"
            ) from None
    return registry, pm
