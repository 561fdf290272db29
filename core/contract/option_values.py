"""Checking a TOML table against a component's options dataclass (:mod:`core.contract.options`).

``build_options`` fills the dataclass, refusing unknown keys, values of the wrong type, NaN
anywhere in a float, and values outside an option's declared bounds with a message that names
the key; a path option's relative value is resolved against the config file that set it
(:func:`origin_of`: the :class:`Table` the config files were read into remembers it). A dataclass may also define ``check()`` for rules across
fields; it raises ``ValueError`` with the message.
"""

from __future__ import annotations

import dataclasses
import math
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from core.contract.errors import ConfigError, PluginError, closest
from core.contract.options import _type_name, bounds_text, fields_of, hints_of, key_of


class Table(dict):
    """A TOML table that remembers, for each of its values, the folder of the file that set it
    (``origins``; the working directory for command-line overrides). Path options resolve
    against it (:func:`core.contract.options.option` with ``path=True``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.origins: dict[str, Path] = {}


def origin_of(table: dict[str, Any], key: str) -> Path | None:
    """The folder relative paths in ``table[key]`` are relative to; None when unknown."""
    return table.origins.get(key) if isinstance(table, Table) else None


def _matches(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin = get_origin(tp)
    if origin is Literal:
        return value in get_args(tp)
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        args = get_args(tp)
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin is dict:
        if not isinstance(value, dict):
            return False
        kt, vt = get_args(tp) or (Any, Any)
        return all(_matches(k, kt) and _matches(v, vt) for k, v in value.items())
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _coerce(value: Any, tp: Any) -> Any:
    """TOML gives ints for floats and lists for tuples: convert to the declared type."""
    origin = get_origin(tp)
    if tp is float and isinstance(value, int):
        return float(value)
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    if origin in (Union, types.UnionType):
        for a in get_args(tp):
            if _matches(value, a):
                return _coerce(value, a)
    return value


def _numbers(value: Any) -> list[Any]:
    """The numbers of a value: itself, or the elements of a list/tuple, or a dict's values."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _numbers(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def nonfinite(value: Any) -> float | None:
    """The first NaN in ``value`` (a number, or inside lists, tuples and dicts), else None."""
    for n in _numbers(value):
        if isinstance(n, float) and math.isnan(n):
            return n
    return None


def check_value(key: str, value: Any, bounds: dict[str, float], inside: bool = False) -> str | None:
    """Why ``value`` breaks the option's constraints (NaN, bounds, a path leaving its folder), or None."""
    if nonfinite(value) is not None:
        return f"{key}: expected a number, got nan (not a number)"
    for n in _numbers(value):
        each = "each must be" if isinstance(value, (list, tuple, dict)) else "must be"
        if not math.isfinite(n):
            return f"{key}: {each} a finite number{' ' + bounds_text(bounds) if bounds else ''}, got {n!r}"
        if not all({"ge": n >= b, "gt": n > b, "le": n <= b, "lt": n < b}[k] for k, b in bounds.items()):
            return f"{key}: {each} {bounds_text(bounds)}, got {n!r}"
    if inside and isinstance(value, str):
        why = escapes(value)
        if why:
            return f"{key}: expected a relative path inside its folder, got {value!r} ({why})"
    return None


def escapes(name: str) -> str:
    """Why the relative path ``name`` would leave its folder ('' when it stays inside)."""
    import os
    from pathlib import PurePosixPath, PureWindowsPath

    if not name:
        return "empty"
    if os.path.isabs(name) or PurePosixPath(name).is_absolute() or PureWindowsPath(name).drive:
        return "absolute"
    if ".." in PurePosixPath(name.replace("\\", "/")).parts:
        return "'..' leaves the folder"
    return ""


TOML_SCALARS = (bool, int, float, str)


def toml_type(tp: Any) -> bool:
    """Can a TOML value be of type ``tp``? Scalars, Literals of them, and lists, tuples and dicts
    (string keys) of those; None inside a union (an option left out). Not a Path, an Enum, a class."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any or tp in TOML_SCALARS or tp in (list, tuple, dict, type(None)):
        return True
    if origin is Literal:
        return all(isinstance(a, TOML_SCALARS) for a in args)
    if origin in (Union, types.UnionType, list, tuple):
        return all(a is Ellipsis or toml_type(a) for a in args)
    return origin is dict and args[0] in (str, Any) and toml_type(args[1])


def unusable_options(cls: type) -> str | None:
    """Why the options dataclass ``cls`` is unusable: an annotation that does not resolve, a type no
    TOML value has, a doc of more than one line, or a default that breaks its own type or bounds
    (checked when a plugin registers it, since only the keys a config sets are checked later); None
    if it is sound."""
    try:
        hints = hints_of(cls)
    except Exception as e:  # noqa: BLE001 - a plugin's annotations may fail in any way
        return f"its type annotations do not resolve ({type(e).__name__}: {e})"
    for f in fields_of(cls):
        if not toml_type(hints[f.name]):
            return (
                f"option {key_of(f)!r} is a {_type_name(hints[f.name])}, which no TOML value is: declare bool, int, float, str, "
                "a Literal of them, or lists, tuples and dicts (string keys) of them"
            )
        if "\n" in f.metadata.get("doc", ""):
            return f"the doc of {key_of(f)!r} spans more than one line; python -m core.plugins prints it on one"
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue  # a required option: the config must set it
        if not _matches(value, hints[f.name]):
            return f"the default of {key_of(f)!r}, {value!r}, is not a {_type_name(hints[f.name])}"
        why = check_value(key_of(f), value, f.metadata.get("bounds") or {}, f.metadata.get("inside", False))
        if why:
            return f"the default of {why}"
    return None


def build_options(cls: type, table: dict[str, Any], where: str) -> Any:
    """Fill ``cls`` from ``table``; ``where`` names the config section, e.g. ``[optimizer]``."""
    hints = hints_of(cls)
    known = {key_of(f): f for f in fields_of(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}{closest(key, known)}; expected one of: {', '.join(sorted(known)) or '(no options)'}")
        name = known[key].name
        tp = hints[name]
        if not _matches(value, tp):
            raise ConfigError(f"{where}.{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        meta = known[key].metadata
        why = check_value(key, value, meta.get("bounds") or {}, meta.get("inside", False))
        if why:
            raise ConfigError(f"{where}.{why}")
        if meta.get("path"):
            value = resolve_path(value, table, key)
        kwargs[name] = _coerce(value, tp)
    unset = [key_of(f) for f in fields_of(cls) if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if unset:
        raise ConfigError(f"{where}: missing key {unset[0]!r} ({known[unset[0]].metadata.get('doc', '')}): this option has no default; set it")
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
    except Exception as e:  # the plugin's own __post_init__: its failure, in one line
        raise PluginError(f"{where}: building the options failed: {type(e).__name__}: {e}") from None
    check = getattr(obj, "check", None)  # declared in core.contract.options: rules across fields
    if callable(check):
        try:
            check()
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        except Exception as e:  # the plugin's check() is to raise ValueError; anything else is its bug, named
            raise PluginError(f"{where}: check() failed: {type(e).__name__}: {e} (check() should raise ValueError)") from None
    return obj


def resolve_path(value: Any, table: dict[str, Any], key: str) -> Any:
    """A path option's value (a string, or each string of a list/dict) made absolute against the
    folder of the file that set it; values with no known origin stay as they are (cwd-relative)."""
    import os

    folder = origin_of(table, key)
    if folder is None:
        return value

    def one(v: Any) -> Any:
        if not isinstance(v, str) or not v or os.path.isabs(v) or "://" in v or v in ("auto", "none"):
            return v
        return os.path.expanduser(v) if v.startswith("~") else os.path.normpath(folder / v)

    if isinstance(value, list):
        return [one(v) for v in value]
    if isinstance(value, dict):
        return {k: one(v) for k, v in value.items()}
    return one(value)
