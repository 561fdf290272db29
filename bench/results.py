"""Every measured figure, one JSON object a line in ``bench/results.jsonl``: what the bench commands
append (through ``bench.common.report``) and ``python -m bench.results [--name TEXT] [--latest]``
prints as a table. docs/benchmarks.md holds the latest figure of each measurement; this file holds
them all.

A row: ``name`` (the section's title, the table row's label and words, and the column, joined by
`` / ``; a cell that holds figures but is not one number goes to the row's ``note``),
``value`` (a number, or null for a row that holds the section's prose in ``note``), ``unit``,
``command``, ``device``, ``date`` (UTC), ``versions``, ``commit`` (the checkout's, ``+dirty`` when it
had changes) and ``note``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results.jsonl"
FIELDS = ("name", "value", "unit", "command", "device", "date", "versions", "commit", "note")

_NUMBER = r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:e[-+]?\d+)?"
_UNITS = ("ms", "s", "x", "%", "GiB/s", "GB/s", "MiB/s", "MiB", "GiB", "tokens/s", "CPU s")
_CELL = re.compile(rf"^({_NUMBER})\s*({'|'.join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))})?\s*(\(.*\))?$")
# columns that tell rows apart (a setting), not figures measured: part of the name
KEY_COLUMNS = ("processes", "examples", "workers", "micro-batch")
_HEADER_UNIT = re.compile(r"(?:^|\s)(GiB/s|GB/s|MiB/s|tokens/s|MiB|GiB|ms|s|%)(?=$|\s|\)|,)")


def number(cell: str) -> tuple[float, str, str] | None:
    """``"1,159 s (all passed)"`` -> ``(1159.0, "s", "all passed")``; None for a cell that is not a figure."""
    m = _CELL.match(cell.replace("`", "").strip())
    if not m or not re.search(r"\d", m.group(1)):
        return None
    return float(m.group(1).replace(",", "")), m.group(2) or "", (m.group(3) or "")[1:-1]


def header_unit(header: str) -> str:
    found = _HEADER_UNIT.findall(header.replace("`", ""))
    return found[-1] if found else ""


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def figures(title: str, body: str) -> list[dict]:
    """The rows of a result section's markdown ``body``: one per figure in its tables, and one
    (value null) holding the prose around them."""
    rows: list[dict] = []
    prose: list[str] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            if lines[i].strip():
                prose.append(lines[i].strip())
            i += 1
            continue
        header = _cells(lines[i])
        i += 1
        while i < len(lines) and lines[i].startswith("|"):
            cells = _cells(lines[i])
            i += 1
            if set("".join(cells)) <= set("-: "):
                continue  # the separator line
            label = cells[0] if number(cells[0]) is None else f"{header[0]} {cells[0]}"
            found, asides = [], []
            for head, cell in zip(header[1:], cells[1:]):
                parsed = number(cell)
                if head in KEY_COLUMNS:
                    label += f", {head} {cell}"
                elif parsed is not None:
                    found.append((head, parsed))
                elif re.search(r"\d", cell):  # a figure that is not one number (a range, counts): beside the row's
                    asides.append(f"{head}: {cell}")
                elif cell:  # a word that tells the rows apart (a writer, a mode): part of the name
                    label += f", {cell}"
            aside = "; ".join(asides)
            for head, (value, unit, own) in found:
                note = "; ".join(x for x in (own, aside) if x)
                rows.append({"name": f"{title} / {label} / {head}", "value": value, "unit": unit or header_unit(head), "note": note})
            if not found:
                rows.append({"name": f"{title} / {label}", "value": None, "unit": "", "note": aside})
    if prose:
        rows.append({"name": title, "value": None, "unit": "", "note": " ".join(prose)})
    return rows


def append(rows: list[dict], path: Path | None = None) -> None:
    with (path or RESULTS).open("a") as f:
        for row in rows:
            f.write(json.dumps({k: row.get(k, "") for k in FIELDS}, ensure_ascii=False) + "\n")


def read(path: Path | None = None) -> list[dict]:
    path = path or RESULTS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def latest(rows: list[dict]) -> list[dict]:
    """The last row appended of each name, in the order of first appearance."""
    last: dict[str, dict] = {}
    for row in rows:
        last[row["name"]] = row
    return list(last.values())


def render(rows: list[dict], full: bool = False) -> str:
    out = ["| date | value | unit | name | device | commit |", "|---|---|---|---|---|---|"]
    for r in rows:
        value = "" if r["value"] is None else f"{r['value']:.6g}"
        name = r["name"] if r["value"] is not None or full else f"{r['name']} (prose: --full)"
        out.append(f"| {r['date']} | {value} | {r['unit']} | {name} | {r['device']} | {r['commit']} |")
        if full:
            out += [f"|  | {k}: {r[k]} |" for k in ("command", "versions", "note") if r[k]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.results", description="Print the recorded benchmark figures as a table.")
    p.add_argument("--name", default="", help="only rows whose name holds this text (case-insensitive)")
    p.add_argument("--latest", action="store_true", help="only the newest row of each name")
    p.add_argument("--full", action="store_true", help="add each row's command, versions and note")
    p.add_argument("--file", type=Path, default=None, help="the rows to read (default: bench/results.jsonl)")
    a = p.parse_args(argv)
    rows = [r for r in read(a.file) if a.name.lower() in r["name"].lower()]
    if a.latest:
        rows = latest(rows)
    try:
        print(render(rows, a.full))
    except BrokenPipeError:  # the table piped into `head`
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
