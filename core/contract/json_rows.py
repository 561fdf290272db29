"""Metric rows as strict JSON (RFC 8259), with their non-finite values kept.

:func:`strict_row` writes each NaN or infinite float as ``null`` and names it, with what it was
(``"NaN"``, ``"Infinity"``, ``"-Infinity"``), in the row's ``not_finite`` object (a key inside a
nested value as ``outer.inner`` or ``outer[2]``); :func:`restore_not_finite` puts the top-level
ones back. The ``jsonl`` monitor writes ``metrics.jsonl`` this way and ``python -m core.report``
reads it back (tests/unit/plugins/test_monitors.py::test_jsonl_lines_are_strict_json_and_say_which_values_were_not_finite).
"""

from __future__ import annotations

import math
from typing import Any

NOT_FINITE = "not_finite"  # a row's names of the values written as null because they were NaN or infinite


def finite_only(value: Any, key: str, found: dict[str, str]) -> Any:
    """``value`` with each NaN or infinite float replaced by None, recorded in ``found`` under its key."""
    if isinstance(value, float) and not math.isfinite(value):
        found[key] = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        return None
    if isinstance(value, dict):
        return {k: finite_only(v, f"{key}.{k}", found) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_only(v, f"{key}[{i}]", found) for i, v in enumerate(value)]
    return value


def strict_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every NaN or infinite float written as None and named in its ``not_finite``
    object (absent when every value is finite), ready for ``json.dumps(..., allow_nan=False)``."""
    found: dict[str, str] = {}
    out = {k: finite_only(v, k, found) for k, v in row.items()}
    if found:
        out[NOT_FINITE] = found
    return out


def restore_not_finite(row: dict[str, Any]) -> dict[str, Any]:
    """A row read back from a :func:`strict_row` line with its top-level non-finite values put back as floats."""
    for key, text in (row.pop(NOT_FINITE, None) or {}).items():
        if key in row and row[key] is None and text in ("NaN", "Infinity", "-Infinity"):
            row[key] = float(text)
    return row
