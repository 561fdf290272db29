"""Options of a component: a dataclass whose fields carry a one-line doc.

    @dataclass
    class AdamWOptions:
        lr: float = option(3e-4, "peak learning rate", gt=0)
        betas: tuple[float, float] = option((0.9, 0.95), "Adam's betas", ge=0, lt=1)  # each element
        filename: str = option("metrics.jsonl", "file inside output_dir", inside=True)

A required option (no default: a config that leaves it unset is refused naming the key, exit 2) is
``option(dataclasses.MISSING, "doc")``; it comes before the fields with defaults, or the dataclass
is ``@dataclass(kw_only=True)``. A list or dict default is allowed: each options object gets its own
copy. Bounds (``ge``, ``gt``, ``le``, ``lt``) apply to a number, or to each element
of a list or tuple, or to each value of a dict, and imply a finite number. ``inside=True`` asks for a
relative path that stays inside its folder (no ``..``, not absolute). A
dataclass may also define ``check()`` for rules across fields; it raises
``ValueError`` with the message. This module declares options and describes them
(``python -m core.plugins``); :mod:`core.contract.option_values` checks a TOML table against them.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

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

    ``default``: the value an unset key takes; ``dataclasses.MISSING`` makes the option required
    (shown as ``(required)``); a list or dict is copied for each options object.

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


def bounds_text(bounds: dict[str, float]) -> str:
    """``{"ge": 0, "lt": 1}`` -> ``">= 0 and < 1"``."""
    return " and ".join(f"{BOUNDS[k]} {v if isinstance(v, int) else f'{v:g}'}" for k, v in bounds.items())


def fields_of(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def key_of(f: dataclasses.Field) -> str:
    """The TOML key of a field: its name, or the ``key`` given to :func:`option`."""
    return f.metadata.get("key") or f.name


def hints_of(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


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
