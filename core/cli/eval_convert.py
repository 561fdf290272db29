"""``python -m core.cli.eval_convert --kind hellaswag|arc|piqa --parquet F [F ...] --out TASK.jsonl``

Converts a benchmark's Hugging Face dataset files (parquet, as ``datasets`` or ``huggingface-cli
download`` leave them on disk) into plait's task format (:mod:`core.loop.evaluation`): one
``{"context", "continuations", "gold", "target_delimiter": " "}`` per line, with the prompts, choices
and delimiter of lm-evaluation-harness's task for the same benchmark (so ``acc_norm`` divides by the
same characters). Rows without an answer (HellaSwag's and
PIQA's unlabelled test splits) are left out and counted. A file that is not parquet, or lacks the
benchmark's columns, is one line naming it, exit 2.

* ``hellaswag`` (``Rowan/hellaswag``): ``activity_label: ctx_a Ctx_b`` -> each of ``endings``; ``label``.
* ``arc`` (``allenai/ai2_arc``, ARC-Easy and ARC-Challenge): ``Question: ...\\nAnswer:`` -> each of
  ``choices.text``; ``answerKey`` in ``choices.label``.
* ``piqa`` (``ybisk/piqa``): ``Question: goal\\nAnswer:`` -> ``sol1``, ``sol2``; ``label``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

from core.contract import log
from core.contract.errors import ArgumentParser, DataError, PlaitError, exit_bad_input


def _hellaswag_text(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag(row: dict[str, Any]) -> dict[str, Any] | None:
    if str(row.get("label", "")).strip() == "":
        return None
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    return {
        "context": _hellaswag_text(row["activity_label"] + ": " + ctx),
        "continuations": [_hellaswag_text(e) for e in row["endings"]],
        "gold": int(row["label"]),
        "target_delimiter": " ",
    }


def arc(row: dict[str, Any]) -> dict[str, Any] | None:
    labels = list(row["choices"]["label"])
    if row.get("answerKey") not in labels:
        return None
    return {
        "context": f"Question: {row['question']}\nAnswer:",
        "continuations": list(row["choices"]["text"]),
        "gold": labels.index(row["answerKey"]),
        "target_delimiter": " ",
    }


def piqa(row: dict[str, Any]) -> dict[str, Any] | None:
    if row.get("label") is None or int(row["label"]) not in (0, 1):
        return None
    return {"context": f"Question: {row['goal']}\nAnswer:", "continuations": [row["sol1"], row["sol2"]], "gold": int(row["label"]), "target_delimiter": " "}


KINDS: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any] | None], tuple[str, ...]]] = {
    "hellaswag": (hellaswag, ("activity_label", "ctx_a", "ctx_b", "endings", "label")),
    "arc": (arc, ("question", "choices", "answerKey")),
    "piqa": (piqa, ("goal", "sol1", "sol2", "label")),
}


def convert(kind: str, files: list[Path]) -> tuple[list[dict[str, Any]], int]:
    """The examples of ``files`` in the task format, and how many rows had no answer."""
    import pyarrow.parquet as pq

    fn, columns = KINDS[kind]
    examples, unlabelled = [], 0
    for f in files:
        try:
            table = pq.read_table(f)
        except Exception as e:  # noqa: BLE001 - pyarrow's ArrowInvalid, OSError: the file is named either way
            raise DataError(f"{f}: not a readable parquet file ({type(e).__name__}: {e})") from None
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise DataError(f"{f}: no column {missing[0]!r}; a {kind} file has {', '.join(columns)}")
        for row in table.to_pylist():
            ex = fn(row)
            if ex is None:
                unlabelled += 1
            else:
                examples.append(ex)
    return examples, unlabelled


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m core.cli.eval_convert", description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--kind", required=True, choices=sorted(KINDS), help="the benchmark the files hold")
    p.add_argument("--parquet", required=True, nargs="+", type=Path, help="the dataset's parquet files (one split, or several)")
    p.add_argument("--out", required=True, type=Path, help="the task file to write (JSON lines)")
    args = p.parse_args(argv)
    try:
        examples, unlabelled = convert(args.kind, args.parquet)
        if not examples:
            raise DataError(f"{', '.join(map(str, args.parquet))}: no row with an answer; expected a labelled split (train, validation)")
    except PlaitError as e:
        exit_bad_input(e)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("".join(json.dumps(ex, ensure_ascii=False) + "\n" for ex in examples), encoding="utf-8")
    tmp.replace(args.out)
    log.info(f"{args.out}: {len(examples)} examples" + (f" ({unlabelled} rows without an answer left out)" if unlabelled else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
