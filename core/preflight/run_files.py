"""The files a run writes beside its checkpoints, and the summary it prints at start.

``config.resolved.toml`` (re-runs the run), ``run_info.json`` (command, device,
versions), and ``exit_status.json`` (exit code, reason, step, detail), which
launchers read because torchrun reports any failed rank as exit code 1.

A run file that cannot be written at start (a full disk, a read-only or failing one) ends the run
before its first step as a failed save does: one line naming the file and the OS error,
``exit_status.json`` (reason ``write_failed``) if even that fits, and exit code 74, which
launchers never retry (:data:`core.checkpoint.folders.EXIT_SAVE_FAILED`).
"""

from __future__ import annotations

import errno
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from core.checkpoint import EXIT_SAVE_FAILED
from core.config import files as config_io
from core.config.sections import data_ranks
from core.contract import log
from core.contract.protocols import DistInfo
from core.preflight.prepare import Prepared
from core.runtime import ownership, watchdog
from core.runtime.durable_io import replace_durable


def library_versions() -> dict[str, str]:
    from importlib import metadata

    from core.config.registry import load

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("plait", "torchao", "torchdata", "numpy", "pluggy", "safetensors"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    for plugin, version in load().third_party.items():  # third-party plugins: "distribution version"
        out[f"plugin:{plugin}"] = version
    return out


def write_run_info(prep: Prepared, dist: DistInfo, versions: dict[str, str]) -> str | None:
    """``config.resolved.toml`` and ``run_info.json`` in ``train.output_dir`` (rank 0). A write
    that fails: the one line to stop with (:func:`start_failed`), naming the file; None: written."""
    if not dist.is_main:
        return None
    out = Path(prep.rc.train.output_dir)
    device = dist.device
    info = {
        "config": prep.source,
        "command": sys.argv,
        "world_size": dist.world_size,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        "backend": dist.backend,
        "checkpoint_dir": str(prep.checkpoint_root.absolute()),  # launchers/remote.sh: did an attempt commit a newer one?
        "versions": versions,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = out
    try:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "config.resolved.toml"
        replace_durable(path, config_io.dumps(prep.resolved))
        path = out / "run_info.json"
        replace_durable(path, json.dumps(info, indent=2) + "\n")
    except OSError as e:
        code = errno.errorcode.get(e.errno or 0, type(e).__name__)
        return f"cannot write {path} at start ({code}: {e.strerror or e}; disk full, read-only or failing?): stopping before the first step"
    return None


def start_failed(output_dir: Path, error: str | None, step: int) -> int:
    """The run files could not be written on rank 0 (``error``; None on the other ranks, which
    stop with it): one line, ``exit_status.json`` if it fits, and exit code 74, never a traceback."""
    if error is not None:
        log.error(error)
        write_exit_status(output_dir, EXIT_SAVE_FAILED, "write_failed", step, error, strict=False)
    return EXIT_SAVE_FAILED


def end_status(output_dir: Path, exit_code: int, reason: str, step: int, detail: str) -> int:
    """``exit_status.json`` at the end of a run (rank 0), and the exit code. A file that cannot be
    written (a disk that filled during the run) is one line and exit code 74: without the file, a
    launcher would take the end for a crash and restart a run that has ended (``launchers/remote.sh``
    reads the line instead)."""
    try:
        write_exit_status(output_dir, exit_code, reason, step, detail)
    except OSError as e:
        code = errno.errorcode.get(e.errno or 0, type(e).__name__)
        log.error(
            f"cannot write {output_dir / 'exit_status.json'} at the end of the run ({code}: {e.strerror or e}; disk full, "
            f"read-only or failing?): the run ended ({reason}) at step {step} with exit code {exit_code}"
        )
        return EXIT_SAVE_FAILED
    return exit_code


def write_exit_status(output_dir: Path, exit_code: int, reason: str, step: int, detail: str, strict: bool = True) -> None:
    """``exit_status.json``; ``strict=False``: a full or read-only disk is logged, not raised. Once the
    stall watchdog has ended the run, its record (reason ``stalled``) stands: what the main thread
    writes after it (a collective broken by another rank's exit) is a consequence, not the cause."""
    ownership.fence()  # rank 0: a folder another job took while this process was stopped ends it here (exit 2)
    if (watchdog.stalled() and reason != "stalled") or ownership.taken:  # taken: the folder is another job's now
        return
    status: dict[str, Any] = {"exit_code": exit_code, "reason": reason, "step": step, "detail": detail}
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        replace_durable(output_dir / "exit_status.json", json.dumps(status) + "\n")  # a launcher never reads half of it
    except OSError as e:
        if strict:
            raise
        log.error(f"cannot write exit_status.json ({e})")
        return
    watchdog.end_recorded(reason)  # a hang in teardown from here on keeps this record


def summary(prep: Prepared, dist: DistInfo, model: torch.nn.Module, run: Any) -> str:
    """What is active, in three lines: printed once at start (rank 0)."""
    rc = prep.rc
    name = lambda slot: rc.slots[slot].component.name  # noqa: E731
    whole = prep.model_meta if dist.pp > 1 and prep.model_meta is not None else model  # a pipeline stage holds only its own
    params = sum(p.numel() for p in {id(p): p for p in whole.parameters()}.values())
    reasons = "; ".join(f"{k}: {v}" for k, v in rc.precision_reasons.items()) if rc.precision_chain else ""
    precision = name("precision") + (f" (fallback skipped {reasons})" if reasons else "")
    train = rc.train
    ac: str = train.activation_checkpointing
    if train.activation_checkpointing == "full" and train.activation_checkpointing_every > 1:
        ac += f" every {train.activation_checkpointing_every}"
    return "\n".join(
        [
            f"plait: model {name('model')}, {params:,} parameters | {name('parallelism')} on {dist.world_size} rank(s), {dist.device} | precision {precision}",
            f"plait: activation checkpointing {ac} | compile {'on' if train.compile else 'off'} | optimizer "
            f"{name('optimizer')} | schedule {name('lr_schedule')} | data {name('data')}",
            f"plait: batch {train.micro_batch} micro x {rc.seq_len} seq x {data_ranks(dist.dp_size, dist.world_size, dist.tp, dist.pp)} x {prep.grad_accum} "
            f"accumulation = {prep.tokens_per_step:,} tokens/step | steps {run.step} -> {run.total_steps}",
        ]
    )
