"""The run's folders at a training start, before any process group: checked, probed, owned.

:func:`check_start` runs the checks of ``core.train`` and ``core.plan`` that touch the run's
folders, in an order that leaves nothing behind when the input is bad: an explicitly named
checkpoint (``checkpoint.resume = "<folder>"``) is checked before any folder is made; then the
output and checkpoint folders are made and probed (:func:`core.runtime.made_folders.probe_folder`), locked (one writer),
the checkpoints to resume from listed and checked, and ``initial_load`` checked. Should any of
those later checks fail, the folders this start created are removed again, each only if empty
(with the lock file this start wrote in them), so bad input never leaves an empty run folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from core.checkpoint import (
    STATE_FILE,
    Checkpointer,
    check_architecture,
    check_fits,
    check_shapes,
    check_stream_world,
    verify,
    warn,
)
from core.contract.errors import CheckpointError
from core.contract.members import member
from core.preflight.plugin_checks import call_plugin
from core.runtime.disk import check_room, checkpoint_bytes
from core.runtime.made_folders import made_by_this_start, probe_folder, remove_created


def check_start(prep: Any, model_meta: torch.nn.Module, lock: bool, dry_run: bool) -> None:
    """The folder checks of a training start (module docstring). ``lock``: take the run folders
    (rank 0 of ``core.train``); ``dry_run`` (``core.plan``): keep no folder it made."""
    rc = prep.rc
    ckpt = rc.sections["checkpoint"]
    if ckpt.resume not in ("auto", "none"):  # bad input found before anything is created
        try:
            verify(Path(ckpt.resume), shards=False)
        except CheckpointError as e:  # the key that named it, first
            raise CheckpointError(f"[checkpoint].resume: {e}") from None
        check_fits(ckpt, Path(ckpt.resume), model_meta, prep.architecture)
    created: list[Path] = []
    try:
        created += probe_folder(Path(rc.train.output_dir), "[train].output_dir", keep=not dry_run)
        what = "[checkpoint].dir" if ckpt.dir else "checkpoint folder <output_dir>/checkpoints"
        created += probe_folder(prep.checkpoint_root, what, keep=not dry_run)
        if lock:  # one writer per run folder, held until this process ends; taken before the listing, so
            # that what a job holding it until now committed and pruned (its last save) is seen
            from core.runtime import ownership

            ownership.lock_run_folders([rc.train.output_dir, prep.checkpoint_root])
        check_checkpoints(prep, model_meta)
    except BaseException:
        remove_created(created)
        raise
    made_by_this_start[:] = created


def check_checkpoints(prep: Any, model_meta: torch.nn.Module) -> None:
    """The checkpoints to resume from (``prep.resume_candidates``), the data source's word on the
    first one, and the weights of ``initial_load`` when there is none."""
    rc, components = prep.rc, prep.components
    ckpt = rc.sections["checkpoint"]
    prep.resume_candidates = Checkpointer.find_resume(ckpt, prep.checkpoint_root, model_meta, prep.architecture)
    if ckpt.every or ckpt.at_end:  # room on the disk for the checkpoints it writes (not for a stop's alone)
        size = checkpoint_bytes(model_meta, member("optimizer", components["optimizer"], "state_bytes_per_param"))
        check_room(prep.checkpoint_root, size, Checkpointer.kept_at_once(ckpt, prep.total_steps), len(prep.resume_candidates), "[checkpoint].dir")
    if ckpt.resume == "auto" and (diverged := Checkpointer.after_divergence(Path(rc.train.output_dir), prep.resume_candidates)) is not None:
        line, candidates = diverged
        warn(line)  # rank 0; core.plan says it too
        if candidates[0] != prep.resume_candidates[0]:
            prep.passed_over = "are from after the previous attempt's divergence began"
        prep.resume_candidates = candidates
    check_resume = member("data", components["data"], "check_resume")
    if prep.resume_from is not None and "data" not in ckpt.exclude_from_loading:
        state = json.loads((prep.resume_from / STATE_FILE).read_text())
        if check_resume is not None:
            call_plugin(f"data {rc.slots['data'].component.name!r}: check_resume", check_resume, state, prep.world_size)
        check_stream_world(prep.resume_from, state, prep.world_size)  # the core's own word, for any stream
    initial = ckpt.initial_load
    if initial and prep.resume_from is None:
        from core.weights import HF_INDEX, hf_index_files, load_weights, weights_kind

        try:
            kind = weights_kind(Path(initial))  # exists, known layout
        except CheckpointError as e:
            raise CheckpointError(f"[checkpoint].initial_load: {e}") from None
        if kind == "hf" and (Path(initial) / HF_INDEX).is_file():
            hf_index_files(Path(initial) / HF_INDEX)  # shard names stay inside the folder
        if kind == "dcp":  # complete, undamaged and of this model's architecture and shape, as a resume's checkpoint is
            verify(Path(initial), shards=False)
            check_shapes(Path(initial), model_meta)
            check_architecture(Path(initial), prep.architecture, explicit=True, initial_load=True)
        else:  # an export: its keys and shapes, from the files' headers
            load_weights(Path(initial), prep.spec, model_meta, shapes_only=True)
