"""``jsonl``: one JSON object per event in ``<output_dir>/metrics.jsonl``, rank 0 only.

Each line carries ``kind`` (``"train"``, ``"val"``, ``"checkpoint"``,
``"resume"`` or ``"end"``), ``step`` and the metrics of the event, as Python numbers (tensors
and numpy scalars converted). Every line is strict JSON (RFC 8259, what ``jq`` and most
parsers accept): a NaN or infinite value is written as ``null``, and the line's
``not_finite`` object names each such key with what it was, ``"NaN"``, ``"Infinity"`` or
``"-Infinity"`` (``{"grad_norm": null, ..., "not_finite": {"grad_norm": "NaN"}}``; a key
inside a nested value as ``outer.inner`` or ``outer[2]``). :func:`core.api.restore_not_finite` puts
the values back (``python -m core.report`` does). Every line is flushed when
written, so a killed run keeps what it logged; a line cut short (a machine crash, a full disk)
is ended before a resumed run appends, so it spoils only itself.

A fresh run (``run.step == 0`` at train start) truncates the file; a resumed
run appends, after a ``"resume"`` line with the step it resumed at. Every line
written before that line with a later step belongs to a history the run left
(the steps lost to a crash, or a branch left by a resume from an older
checkpoint): ``python -m core.report`` drops them, and readers should too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

from core.api import hookimpl, option, strict_row


def plain(value: Any) -> Any:
    """A JSON-ready value: tensors and numpy values become Python numbers or lists."""
    if hasattr(value, "tolist") and hasattr(value, "ndim"):  # torch tensors, numpy arrays and scalars
        value = value.item() if value.ndim == 0 else value.tolist()
    elif isinstance(value, PurePath):
        value = str(value)
    elif isinstance(value, dict):
        value = {str(k): plain(v) for k, v in value.items()}
    elif isinstance(value, (list, tuple)):
        value = [plain(v) for v in value]
    return value


def ends_inside_a_line(path: Path) -> bool:
    """Whether the file exists, is not empty, and its last line lacks its newline."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            if f.tell() == 0:
                return False
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except FileNotFoundError:
        return False


# what plait itself keeps in train.output_dir: metrics appended there would damage it
RUN_FILES = ("config.resolved.toml", "run_info.json", "exit_status.json", "plait.lock", "budget_ledger.json", "checkpoints", "tensorboard")


@dataclass
class JsonlOptions:
    filename: str = option("metrics.jsonl", "file name inside train.output_dir", inside=True)

    def check(self) -> None:
        parts = [p for p in PurePosixPath(self.filename.replace("\\", "/")).parts if p != "."]
        if not parts or self.filename.endswith(("/", "\\")):
            raise ValueError(f"filename: expected a file name inside train.output_dir, got {self.filename!r} (a folder)")
        if parts[0] in RUN_FILES:
            raise ValueError(f"filename: {self.filename!r} is where plait keeps its own {parts[0]}; choose another name")


class Jsonl:
    def __init__(self, options: JsonlOptions) -> None:
        self.options = options
        self.file = None

    def _write(self, kind: str, step: int, record: dict[str, Any]) -> None:
        if self.file is None:
            return
        row = strict_row({"kind": kind, "step": int(step), **{k: plain(v) for k, v in record.items()}})
        self.file.write(json.dumps(row, allow_nan=False, default=str) + "\n")
        self.file.flush()

    @hookimpl
    def plait_train_start(self, run):
        if not run.dist.is_main:
            return
        path = run.output_dir / self.options.filename
        path.parent.mkdir(parents=True, exist_ok=True)  # a filename may name a sub-folder of output_dir
        cut = run.step > 0 and ends_inside_a_line(path)
        self.file = path.open("a" if run.step > 0 else "w", buffering=1, encoding="utf-8")
        if cut:  # a machine crash or a full disk cut the last line: end it, so the resume line stands alone
            self.file.write("\n")
        if run.step > 0:
            self._write("resume", run.step, {"tokens_seen": run.tokens_seen})

    @hookimpl
    def plait_step_end(self, run, step, metrics):
        if metrics:
            self._write("train", step, metrics)

    @hookimpl
    def plait_validation_end(self, run, step, metrics):
        self._write("val", step, metrics)

    @hookimpl
    def plait_checkpoint_saved(self, run, step, path):
        self._write("checkpoint", step, {"path": str(path)})

    @hookimpl
    def plait_train_end(self, run, reason):
        self._write("end", run.step, {"reason": reason, "tokens_seen": run.tokens_seen})
        if self.file is not None:
            self.file.close()
            self.file = None
