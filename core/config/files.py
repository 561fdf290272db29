"""TOML files with ``extends`` inheritance and ``--section.key=value`` overrides.

This module knows files and dicts only; what the keys mean is decided in
:mod:`core.config.sections` and by each plugin's options dataclass. A config may
nest tables and arrays at most :data:`MAX_DEPTH` levels deep, hold at most
:data:`MAX_VALUES` keys and array items, and chain at most :data:`MAX_EXTENDS`
files through ``extends``; each file, and each command-line value, is at most
:data:`MAX_BYTES` long. A config past a limit is one line, read no further.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from core.config.sections import CORE_SECTION_OPTIONS, SLOT_CORE_KEYS
from core.contract.errors import ConfigError
from core.contract.option_values import Table, origin_of

MAX_EXTENDS = 64  # files in one extends chain
MAX_DEPTH = 64  # nesting levels of tables and arrays
MAX_BYTES = 1 << 20  # one config file, or one command-line value
MAX_VALUES = 100_000  # keys and array items in one file, and in the merged config


def values_exceed(value: Any, limit: int = MAX_VALUES) -> bool:
    """Whether ``value`` holds more than ``limit`` keys and array items, all levels together."""
    stack, seen = [value], 0
    while stack:
        v = stack.pop()
        children = list(v.values()) if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        seen += len(children)
        if seen > limit:
            return True
        stack.extend(children)
    return False


def depth_exceeds(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests dicts and lists more than ``limit`` levels deep (no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if d > limit:
            return True
        stack.extend((c, d + 1) for c in children)
    return False


def _loads(text: str, where: str) -> dict[str, Any]:
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{where}: longer than {MAX_BYTES} characters; expected a config of at most {MAX_BYTES >> 20} MiB")
    try:
        data = tomllib.loads(text)
    except RecursionError:
        data = None
    if data is None or depth_exceeds(data):
        raise ConfigError(f"{where}: nested more than {MAX_DEPTH} levels deep; expected at most {MAX_DEPTH} levels of tables and arrays")
    if values_exceed(data):
        raise ConfigError(f"{where}: more than {MAX_VALUES} keys and array items; expected at most {MAX_VALUES}")
    return data


def tag(data: dict[str, Any], folder: Path) -> Table:
    """``data`` as nested Tables whose values all come from ``folder``."""
    out = Table()
    for key, value in data.items():
        if isinstance(value, dict):
            value = tag(value, folder)
        elif isinstance(value, list):  # inline tables in arrays (mixture sources)
            value = [tag(v, folder) if isinstance(v, dict) else v for v in value]
        out[key] = value
        out.origins[key] = folder
    return out


def subtable(table: dict[str, Any], drop: tuple[str, ...] = ()) -> Table:
    """A copy of ``table`` without the keys in ``drop``, keeping the origins of the rest."""
    out = Table({k: v for k, v in table.items() if k not in drop})
    out.origins = {k: v for k, v in (table.origins if isinstance(table, Table) else {}).items() if k not in drop}
    return out


UNSET = "@default"  # a value that removes an inherited key (the plugin's default applies)
# Keys of a slot section that belong to the core, not to the plugin, so they survive a plugin
# switch (:data:`core.config.sections.SLOT_CORE_KEYS`: data.seq_len).
KEEP_ON_SWITCH: dict[str, tuple[str, ...]] = {slot: tuple(keys) for slot, keys in SLOT_CORE_KEYS.items()}


def switches_plugin(base: dict[str, Any], over: dict[str, Any]) -> bool:
    """Does ``over`` name another plugin for this section than ``base`` does? Then ``base``'s keys
    belong to the other plugin and must not follow (a ``fallback`` chain counts as a choice too)."""
    if "name" in over and "name" not in base and "fallback" not in base:
        return False  # the section used its default plugin: its keys stay
    if "name" in over:
        return over["name"] != base.get("name") or "fallback" in base
    return "fallback" in over and "name" in base and "fallback" not in base


def for_new_plugin(base: dict[str, Any], name: Any, keep: tuple[str, ...] = ()) -> Table:
    """What survives a switch to plugin ``name``: the core's own keys of the section (``keep``) and
    a ``[section.<name>]`` sub-table of options (how a fallback chain keeps each entry's options),
    hoisted into the section."""
    out = subtable(base, tuple(k for k in base if k not in keep))
    sub = base.get(name) if isinstance(name, str) else None
    if isinstance(sub, dict):
        out = deep_merge(out, sub)
    return out


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> Table:
    """``over`` on top of ``base``: tables merge key by key, anything else replaces; a table that
    switches plugin (another ``name``) starts from nothing of ``base``'s; ``"@default"`` removes a key."""
    out = copy.deepcopy(base)
    if not isinstance(out, Table):
        out = Table(out)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            switch = switches_plugin(out[key], value)
            start = for_new_plugin(out[key], value.get("name"), KEEP_ON_SWITCH.get(key, ())) if switch else out[key]
            out[key] = deep_merge(start, value)
        elif value == UNSET:
            out.pop(key, None)
            out.origins.pop(key, None)
            continue
        else:
            out[key] = copy.deepcopy(value)
        where = origin_of(over, key)
        if where is not None:
            out.origins[key] = where
    return out


def load_file(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a TOML file and the files it ``extends`` (paths relative to it)."""
    path = Path(path)
    resolved = path.resolve()
    if resolved in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, resolved))
        raise ConfigError(f"extends cycle: {cycle}")
    if len(_chain) >= MAX_EXTENDS:
        raise ConfigError(f"{_chain[0]}: extends chain longer than {MAX_EXTENDS} files (at {path}); expected at most {MAX_EXTENDS}")
    if not path.is_file():
        via = f" (extended by {_chain[-1]})" if _chain else ""
        raise ConfigError(f"config file {path} not found{via}")
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)  # a larger file is refused unread: no parse of megabytes of keys
        if len(raw) > MAX_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_BYTES >> 20} MiB; expected a config of at most {MAX_BYTES >> 20} MiB")
        data = _loads(raw.decode(), str(path))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: unreadable ({type(e).__name__}: {e.strerror or e})") from None
    parents = data.pop("extends", None)
    data = tag(data, resolved.parent)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not (isinstance(parents, list) and all(isinstance(p, str) for p in parents)):
        raise ConfigError(f"{path}: extends: expected a path or a list of paths, got {parents!r}")
    merged: dict[str, Any] = {}
    for parent in parents:
        merged = deep_merge(merged, load_file(resolved.parent / parent, (*_chain, resolved)))
    return deep_merge(merged, data)


def parse_value(text: str) -> Any:
    """A CLI value as a TOML literal (``3e-4``, ``true``, ``[1, 2]``, ``"x"``); else a bare string."""
    try:
        return _loads(f"v = {text}", "command line")["v"]
    except tomllib.TOMLDecodeError:
        return text


def section_hint(key: str) -> str:
    """`` (did you mean --train.steps?)`` when a core section has an option named ``key``."""
    import dataclasses

    for section, cls in CORE_SECTION_OPTIONS.items():
        if any((f.metadata.get("key") or f.name) == key for f in dataclasses.fields(cls)):
            return f" (did you mean --{section}.{key}?)"
    return ""


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """``["--a.b=1", "--c.d", "x"]`` -> ``[("a.b", 1), ("c.d", "x")]``."""
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"command line: expected --section.key=value, got {arg!r}")
        body = arg[2:]
        if "=" in body:
            key, text = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, text = body, args[i + 1]
            i += 1
        else:
            key, text = body, "true"  # a bare flag such as --budget.force
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"command line: bad key in {arg!r}")
        if "." not in key:
            raise ConfigError(f"command line: {arg!r} names no section; expected --section.key=value{section_hint(key.replace('-', '_'))}")
        out.append((key.replace("-", "_"), parse_value(text)))
        i += 1
    return out


def apply_overrides(cfg: dict[str, Any], overrides: list[tuple[str, Any]]) -> dict[str, Any]:
    """Command-line values on top of ``cfg``. A ``--section.name=`` that switches plugin is applied
    first and drops the section's keys for the old plugin; ``--section.key=@default`` removes a key."""
    out = copy.deepcopy(cfg)
    switches = [(k, v) for k, v in overrides if k.endswith(".name") and k.count(".") == 1]
    for key, value in switches:
        section = key.split(".")[0]
        current = out.get(section)
        if isinstance(current, dict) and switches_plugin(current, {"name": value}):
            out[section] = for_new_plugin(current, value, KEEP_ON_SWITCH.get(section, ()))
    for key, value in overrides:
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, Table())
            if not isinstance(child, dict):
                raise ConfigError(f"command line: --{key}: {part!r} is a value, not a section")
            node = child
        if value == UNSET:
            node.pop(parts[-1], None)
            continue
        node[parts[-1]] = value
        if isinstance(node, Table):
            node.origins[parts[-1]] = Path.cwd()  # command-line paths are relative to where it runs
    return out


def load(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    cfg = apply_overrides(load_file(path), parse_overrides(overrides or []))
    if depth_exceeds(cfg):
        raise ConfigError(f"command line: an override nests more than {MAX_DEPTH} levels deep; expected at most {MAX_DEPTH}")
    if values_exceed(cfg):
        raise ConfigError(f"{path}: with its extends and overrides, more than {MAX_VALUES} keys and array items; expected at most {MAX_VALUES}")
    return cfg


# --- writing ---------------------------------------------------------------


def _toml_key(key: str) -> str:
    return key if key and all(c.isalnum() or c in "_-" for c in key) else _toml_scalar(key)


def _toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_scalar(v)}" for k, v in value.items()) + "}"
    if value is None:
        raise ConfigError("cannot write None to TOML")
    return _toml_scalar(str(value))


def dumps(cfg: dict[str, Any]) -> str:
    """Write a nested dict as TOML (None values are left out)."""
    lines: list[str] = []

    def table(prefix: str, node: dict[str, Any]) -> None:
        scalars = {k: v for k, v in node.items() if not isinstance(v, dict) and v is not None}
        tables = {k: v for k, v in node.items() if isinstance(v, dict)}
        if prefix and (scalars or not tables):
            lines.append(f"\n[{prefix}]")
        for k, v in scalars.items():
            lines.append(f"{_toml_key(k)} = {_toml_scalar(v)}")
        for k, v in tables.items():
            table(f"{prefix}.{_toml_key(k)}" if prefix else _toml_key(k), v)

    table("", cfg)
    return "\n".join(lines).lstrip("\n") + "\n"
