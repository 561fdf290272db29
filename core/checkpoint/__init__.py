"""Checkpoints: saving, resuming and pruning a run's training state. The rest of plait uses the
names below and no submodule (import-linter: "core.checkpoint has one door")."""

from core.checkpoint.checkpointer import Checkpointer, SavePoints, observe
from core.checkpoint.folders import (
    COMMIT_MARKER,
    COPY_NAMES,
    EXIT_SAVE_FAILED,
    STATE_FILE,
    SaveFailed,
    check_architecture,
    check_fits,
    check_shapes,
    checkpoint_holding,
    committed,
    current_run,
    folder_of_checkpoints,
    io_error,
    lineage_of,
    run_architecture,
    verify,
    warn,
)
from core.checkpoint.resume import (
    CheckpointDir,
    TrainingState,
    check_stream_world,
    config_differences,
    find_resume,
    read_model,
    seed_everything,
)
from core.checkpoint.retention import after_divergence, kept_at_once, later_than, retained
from core.checkpoint.safe_dcp import NonFiniteState

__all__ = [
    "COMMIT_MARKER",
    "COPY_NAMES",
    "EXIT_SAVE_FAILED",
    "STATE_FILE",
    "CheckpointDir",
    "Checkpointer",
    "NonFiniteState",
    "SaveFailed",
    "SavePoints",
    "TrainingState",
    "after_divergence",
    "check_architecture",
    "check_fits",
    "check_shapes",
    "check_stream_world",
    "checkpoint_holding",
    "committed",
    "config_differences",
    "current_run",
    "find_resume",
    "folder_of_checkpoints",
    "io_error",
    "kept_at_once",
    "later_than",
    "lineage_of",
    "observe",
    "read_model",
    "retained",
    "run_architecture",
    "seed_everything",
    "verify",
    "warn",
]
