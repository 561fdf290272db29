"""``tensorboard``: scalars in ``<output_dir>/<subdir>``, rank 0 only.

Training metrics go to ``train/<name>`` (``train/loss``, ``train/lr``,
``train/grad_norm``, ``train/tokens_per_s``...) plus ``train/perplexity`` =
``exp(loss)``; validation metrics to ``val/<name>`` with a leading ``val_``
dropped (``val_loss`` -> ``val/loss``); evaluation metrics (the ``downstream`` monitor's
``eval/<task>/acc``, ``eval/time_s``...) under their own name, TensorBoard's ``eval`` section.
``global_step`` is the step. A resumed
run purges events its output folder holds from steps after the checkpoint.

Events are written on the training thread (no writer thread) and flushed at each step that logged
and at each checkpoint. A write that fails (a full disk, a read-only or failing one) is one warning
line; the monitor writes no more events and the run goes on (a full disk that also holds the
checkpoints ends the run at the next save, exit 74). Shown by ``tests/faults/test_disk_room.py``.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from core.api import PluginError, hookimpl, log, option

SKIP = {"step"}
OWN_SECTIONS = ("eval/",)  # step metrics named with one of these keep their name as the tag: their own section
_files = itertools.count()  # events files this process opened: part of each file's name


def scalar(value: Any) -> float | None:
    """A real number as float, or None for anything that is not one scalar."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


@dataclass
class TensorBoardOptions:
    subdir: str = option("tensorboard", "folder inside train.output_dir for the event files", inside=True)


class EventFile:
    """One TensorBoard events file (TFRecord framing of ``Event`` protos), written by the caller's thread."""

    def __init__(self, folder: Path, purge_step: int | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_files)}"
        self.file: BinaryIO = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self.records = RecordWriter(self.file)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:  # TensorBoard hides this folder's events at or after purge_step written before it
            self._write(Event(wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def _write(self, event: Any) -> None:
        self.records.write(event.SerializeToString())

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value)])
        self._write(self._event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoard:
    def __init__(self, options: TensorBoardOptions) -> None:
        self.options = options
        self.writer: EventFile | None = None
        self.folder: Path | None = None
        try:  # lazy: only runs that enable this monitor pay for the import
            import tensorboard.compat.proto.event_pb2  # noqa: F401
        except ImportError as e:
            raise PluginError(f"monitor 'tensorboard' needs the tensorboard package (pip install tensorboard): {e}") from None

    def _failed(self, e: OSError) -> None:
        """A write that failed: one warning, the file closed quietly, no more events this run."""
        writer, self.writer = self.writer, None
        where = e.filename or (writer.path if writer is not None else self.folder)
        if writer is not None:
            try:
                writer.close()  # flushes what is buffered: it may fail the same way
            except OSError:
                pass
        code = errno.errorcode.get(e.errno or 0, type(e).__name__)
        log.warn(f"monitor 'tensorboard': cannot write {where} ({code}: {e.strerror or e}; disk full, read-only or failing?): no more events this run")

    def _guarded(self, write: Any) -> None:
        if self.writer is None:
            return
        try:
            write(self.writer)
        except OSError as e:
            self._failed(e)

    @hookimpl
    def plait_train_start(self, run):
        if not run.dist.is_main:
            return
        self.folder = run.output_dir / self.options.subdir
        try:
            self.writer = EventFile(self.folder, purge_step=run.step + 1 if run.step else None)
        except OSError as e:
            self._failed(e)

    def _scalars(self, writer: EventFile, prefix: str, step: int, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            v = scalar(value)
            if key in SKIP or v is None:
                continue
            if prefix == "val" and key.startswith("val_"):
                key = key[len("val_") :]
            writer.add_scalar(key if key.startswith(OWN_SECTIONS) else f"{prefix}/{key}", v, step)

    @hookimpl
    def plait_step_end(self, run, step, metrics):
        if not metrics:
            return

        def write(writer: EventFile) -> None:
            self._scalars(writer, "train", step, metrics)
            loss = scalar(metrics.get("loss"))
            if loss is not None and math.isfinite(loss) and loss < 700:  # exp overflows past ~709
                writer.add_scalar("train/perplexity", math.exp(loss), step)
            writer.flush()

        self._guarded(write)

    @hookimpl
    def plait_validation_end(self, run, step, metrics):
        self._guarded(lambda writer: (self._scalars(writer, "val", step, metrics), writer.flush()))

    @hookimpl
    def plait_checkpoint_saved(self, run, step, path):
        self._guarded(EventFile.flush)

    @hookimpl
    def plait_train_end(self, run, reason):
        self._guarded(EventFile.close)
        self.writer = None
