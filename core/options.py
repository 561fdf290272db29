"""Options of a component: a dataclass whose fields carry a one-line doc.

    @dataclass
    class AdamWOptions:
        lr: float = option(3e-4, "peak learning rate")

``build_options`` fills such a dataclass from a TOML table, refusing unknown
keys, values of the wrong type, NaN anywhere in a float, and values outside an
option's declared bounds with a message that names the key::

    lr: float = option(3e-4, "peak learning rate", gt=0)
    betas: tuple[float, float] = option((0.9, 0.95), "Adam's betas", ge=0, lt=1)  # each element
    filename: str = option("metrics.jsonl", "file inside output_dir", inside=True)

Bounds (``ge``, ``gt``, ``le``, ``lt``) apply to a number, or to each element
of a list or tuple, or to each value of a dict, and imply a finite number. ``inside=True`` asks for a
relative path that stays inside its folder (no ``..``, not absolute). A
dataclass may also define ``check()`` for rules across fields; it raises
``ValueError`` with the message.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from core.errors import ConfigError, closest

BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def option(
    default: Any,
    doc: str,
    key: str | None = None,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    inside: bool = False,
    path: bool = False,
    **kwargs: Any,
) -> Any:
    """A dataclass field with a one-line ``doc`` shown by ``python -m core.plugins``.

    ``key`` spells the TOML key when it cannot be a Python name (``async``).
    ``ge``/``gt``/``le``/``lt`` bound a number (each element of a list, tuple
    or dict); ``inside`` asks for a relative path that stays in its folder.
    ``path`` marks a file or folder: a relative value is resolved against the
    folder of the config file that set it (the working directory for a
    command-line override), so a config runs the same from any directory.
    """
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    meta = {"doc": doc, "key": key, "bounds": bounds, "inside": inside, "path": path}
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta, **kwargs)
    return dataclasses.field(default=default, metadata=meta, **kwargs)


@dataclasses.dataclass
class NoOptions:
    """For components without options."""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


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


def bounds_text(bounds: dict[str, float]) -> str:
    """``{"ge": 0, "lt": 1}`` -> ``">= 0 and < 1"``."""
    return " and ".join(f"{BOUNDS[k]} {v if isinstance(v, int) else f'{v:g}'}" for k, v in bounds.items())


def check_value(key: str, value: Any, bounds: dict[str, float], inside: bool = False) -> str | None:
    """Why ``value`` breaks the option's constraints (NaN, bounds, a path leaving its folder), or None."""
    if nonfinite(value) is not None:
        return f"{key}: expected a number, got nan (not a number)"
    for n in _numbers(value):
        ok = math.isfinite(n) and all({"ge": n >= b, "gt": n > b, "le": n <= b, "lt": n < b}[k] for k, b in bounds.items())
        if not ok:
            each = "each must be" if isinstance(value, (list, tuple, dict)) else "must be"
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


def fields_of(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def key_of(f: dataclasses.Field) -> str:
    """The TOML key of a field: its name, or the ``key`` given to :func:`option`."""
    return f.metadata.get("key") or f.name


def hints_of(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


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
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
    check = getattr(obj, "check", None)
    if callable(check):
        try:
            check()
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    return obj


def resolve_path(value: Any, table: dict[str, Any], key: str) -> Any:
    """A path option's value (a string, or each string of a list/dict) made absolute against the
    folder of the file that set it; values with no known origin stay as they are (cwd-relative)."""
    import os

    from core.config import origin_of

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


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, doc) for each option, for ``python -m core.plugins``."""
    hints = hints_of(cls)
    rows = []
    for f in fields_of(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "(required)"
        doc = f.metadata.get("doc", "")
        bounds = f.metadata.get("bounds")
        if bounds:
            doc += f" ({'each ' if get_origin(hints[f.name]) in (list, tuple, dict) else ''}{bounds_text(bounds)})"
        if f.metadata.get("inside"):
            doc += " (a relative path inside its folder)"
        if f.metadata.get("path"):
            doc += " (a path: relative to the config file that sets it)"
        rows.append((key_of(f), _type_name(hints[f.name]), default, doc))
    return rows


def undocumented(cls: type) -> list[str]:
    return [f.name for f in fields_of(cls) if not f.metadata.get("doc")]


def to_dict(obj: Any) -> dict[str, Any]:
    """Options as their TOML table (keys spelled as in TOML)."""
    return {key_of(f): _plain(getattr(obj, f.name)) for f in fields_of(type(obj))}


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
