"""TOML files with ``extends`` inheritance and ``--section.key=value`` overrides.

This module knows files and dicts only; what the keys mean is decided in
:mod:`core.run_config` and by each plugin's options dataclass. A config may
nest tables and arrays at most :data:`MAX_DEPTH` levels deep and chain at
most :data:`MAX_EXTENDS` files through ``extends``.
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

from core.errors import ConfigError

MAX_EXTENDS = 64  # files in one extends chain
MAX_DEPTH = 64  # nesting levels of tables and arrays


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
    try:
        data = tomllib.loads(text)
    except RecursionError:
        data = None
    if data is None or depth_exceeds(data):
        raise ConfigError(f"{where}: nested more than {MAX_DEPTH} levels deep; expected at most {MAX_DEPTH} levels of tables and arrays")
    return data


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``: tables merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
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
        data = _loads(path.read_text(), str(path))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: unreadable ({type(e).__name__}: {e.strerror or e})") from None
    parents = data.pop("extends", None)
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
        out.append((key.replace("-", "_"), parse_value(text)))
        i += 1
    return out


def apply_overrides(cfg: dict[str, Any], overrides: list[tuple[str, Any]]) -> dict[str, Any]:
    out = copy.deepcopy(cfg)
    for key, value in overrides:
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"command line: --{key}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def load(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    cfg = apply_overrides(load_file(path), parse_overrides(overrides or []))
    if depth_exceeds(cfg):
        raise ConfigError(f"command line: an override nests more than {MAX_DEPTH} levels deep; expected at most {MAX_DEPTH}")
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
