"""A run's config resolved: every core section filled, and a component chosen for every slot.

:func:`resolve` checks every key of a loaded config (:mod:`core.config.files`) against the core's
own sections (:mod:`core.config.sections`) and the options of the plugin each slot section names
(:mod:`core.config.registry`), and returns a :class:`RunConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.config.files import subtable
from core.config.registry import Component, Registry
from core.config.sections import (
    CORE_SECTIONS,
    DEFAULT_PLUGIN,
    EXTRA_SECTIONS,
    SLOT_CORE_KEYS,
    SLOT_SECTIONS,
    MonitorsOptions,
    TrainOptions,
)
from core.contract import mup
from core.contract.errors import ConfigError, PluginError, closest
from core.contract.option_values import _matches, build_options, nonfinite
from core.contract.options import _type_name, to_dict


@dataclass
class Chosen:
    """A component picked by the config, with its filled options."""

    component: Component
    options: Any
    section: str

    def instantiate(self) -> Any:
        c = self.component
        try:
            return c.factory(self.options)
        except (ConfigError, PluginError):
            raise
        except (ValueError, TypeError, ImportError) as e:
            raise PluginError(f"[{self.section}] {c.slot} {c.name!r} from {c.provider}: {e}") from None
        except Exception as e:  # any other failure of the plugin's own code is its problem, said in one line
            raise PluginError(f"[{self.section}] {c.slot} {c.name!r} from {c.provider} failed: {type(e).__name__}: {e}") from None


@dataclass
class RunConfig:
    """A validated run: core options plus the chosen component of every slot."""

    train: TrainOptions
    monitors_options: MonitorsOptions
    core_keys: dict[str, dict[str, Any]]
    slots: dict[str, Chosen]
    monitors: list[Chosen]
    sections: dict[str, Any] = field(default_factory=dict)  # options of EXTRA_SECTIONS, by section
    precision_chain: list[Chosen] = field(default_factory=list)  # precision.fallback, in order
    precision_reasons: dict[str, str] = field(default_factory=dict)  # why earlier entries were skipped

    @property
    def seq_len(self) -> int:
        return self.core_keys["data"]["seq_len"]

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved config, every default filled in."""
        out: dict[str, Any] = {"train": to_dict(self.train)}
        for slot, chosen in self.slots.items():
            out[chosen.section] = {"name": chosen.component.name, **self.core_keys.get(slot, {}), **to_dict(chosen.options)}
        if self.precision_chain:
            out["precision"] = {
                "name": self.slots["precision"].component.name,
                "fallback": [c.component.name for c in self.precision_chain],
                "fallback_reasons": dict(self.precision_reasons),
                **{c.component.name: to_dict(c.options) for c in self.precision_chain},
            }
        out["monitors"] = {"enabled": list(self.monitors_options.enabled)}
        for m in self.monitors:
            out["monitors"][m.component.name] = to_dict(m.options)
        for section, opts in self.sections.items():
            out[section] = to_dict(opts)
        return out


def resolve(cfg: dict[str, Any], registry: Registry, source: str = "config") -> RunConfig:
    """Check every key of ``cfg`` and pick a component for every slot."""
    cfg = {k: v for k, v in cfg.items() if k != "derived"}  # written by plait into config.resolved.toml for the reader
    known = set(CORE_SECTIONS) | set(SLOT_SECTIONS.values()) | set(EXTRA_SECTIONS)
    for key, value in cfg.items():
        if key not in known:
            raise ConfigError(f"{source}: unknown section [{key}]{closest(key, known)}; expected one of: {', '.join(sorted(known))}")
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a table [{key}], got {type(value).__name__}")

    train = build_options(TrainOptions, cfg.get("train", {}), f"{source}: [train]")

    slots: dict[str, Chosen] = {}
    core_keys: dict[str, dict[str, Any]] = {}
    precision_chain: list[Chosen] = []
    for slot, section in SLOT_SECTIONS.items():
        table = subtable(cfg.get(section, {}))  # keeps where each value came from (path options)
        name = table.pop("name", DEFAULT_PLUGIN[slot])
        if name is None:
            raise ConfigError(f'{source}: [{section}] needs name = "..."; installed: {", ".join(registry.names(slot))}')
        if not isinstance(name, str):
            raise ConfigError(f"{source}: [{section}].name: expected a plugin name (str), got {name!r}")
        if slot == "precision" and table.get("fallback"):
            chain = resolve_precision_chain(table, registry, f"{source}: [{section}]")
            slots[slot] = chain[0]  # core.preflight.prepare picks the first supported one
            core_keys[slot] = {}
            precision_chain = chain
            continue
        table.pop("fallback", None)
        table.pop("fallback_reasons", None)
        ck = {}
        for key, (tp, default, _doc) in SLOT_CORE_KEYS.get(slot, {}).items():
            value = table.pop(key, default)
            if tp is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"{source}: [{section}].{key}: expected a positive int, got {value!r}")
            if tp is not int and not _matches(value, tp):
                raise ConfigError(f"{source}: [{section}].{key}: expected {_type_name(tp)}, got {value!r}")
            if nonfinite(value) is not None:
                raise ConfigError(f"{source}: [{section}].{key}: expected numbers, got nan (not a number) in {value!r}")
            ck[key] = value
        core_keys[slot] = ck
        where = f"{source}: [{section}]"
        component = registry.get(slot, name, where)
        if slot == "model":
            mup.unasked_option(table, component.options, name, where)
        options = build_options(component.options, table, f"{where} ({slot} {name!r})")
        slots[slot] = Chosen(component, options, section)

    mon_table = dict(cfg.get("monitors", {}))
    mon_opts_tables = {k: mon_table.pop(k) for k in list(mon_table) if isinstance(mon_table[k], dict)}
    monitors_options = build_options(MonitorsOptions, mon_table, f"{source}: [monitors]")
    twice = sorted({n for n in monitors_options.enabled if monitors_options.enabled.count(n) > 1})
    if twice:
        raise ConfigError(f"{source}: [monitors].enabled lists {twice[0]!r} twice; expected each monitor once")
    monitors = []
    for name in monitors_options.enabled:
        component = registry.get("monitor", name, f"{source}: monitors.enabled")
        options = build_options(component.options, mon_opts_tables.pop(name, {}), f"{source}: [monitors.{name}]")
        monitors.append(Chosen(component, options, f"monitors.{name}"))
    if mon_opts_tables:
        extra = sorted(mon_opts_tables)
        raise ConfigError(f"{source}: [monitors.{extra[0]}] configures a monitor that is not in monitors.enabled = {monitors_options.enabled}")

    sections = {section: build_options(cls, cfg.get(section, {}), f"{source}: [{section}]") for section, cls in EXTRA_SECTIONS.items()}
    return RunConfig(train, monitors_options, core_keys, slots, monitors, sections, precision_chain)


def resolve_precision_chain(table: dict[str, Any], registry: Registry, where: str) -> list[Chosen]:
    """``fallback = ["mxfp8", "fp8", "bf16"]``; each entry's options come from ``[precision.<name>]``."""
    chain = table.pop("fallback")
    table.pop("fallback_reasons", None)
    table.pop("name", None)  # the chain decides; a resolved config records the choice here
    if not (isinstance(chain, list) and chain and all(isinstance(n, str) for n in chain)):
        raise ConfigError(f"{where}.fallback: expected a non-empty list of precision plugin names, got {chain!r}")
    out = []
    for name in chain:
        component = registry.get("precision", name, f"{where}.fallback")
        sub = table.pop(name, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"{where}.{name}: expected a table of {name!r} options, got {sub!r}")
        out.append(Chosen(component, build_options(component.options, sub, f"{where}.{name}"), "precision"))
    if table:
        key = sorted(table)[0]
        raise ConfigError(f"{where}: unknown key {key!r}; with a fallback chain, put each plugin's options in [precision.<name>]")
    return out


def build_component(slot: str, name: str, table: dict[str, Any], where: str, drop: tuple[str, ...] = ()) -> Any:
    """What component ``name`` of ``slot`` makes from the options in ``table`` less the keys in
    ``drop``, checked as a slot section's are (path options resolve against the file that set
    them); for plugins made of plugins, such as a mixture's sources. ``where`` names the table in
    errors, e.g. ``[data] mixture: sources[0]``. Loads the installed plugins once per process."""
    from core.config import registry

    component = registry.load().get(slot, name, where)
    return component.factory(build_options(component.options, subtable(table, drop), f"{where} ({name})"))
