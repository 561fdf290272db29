"""What a run is made of, declared once: the core's own sections, and the keys it keeps in slot sections.

A run's TOML has the core sections ``[train]`` (:class:`TrainOptions`), ``[checkpoint]``
(:class:`CheckpointOptions`), ``[validation]`` (:class:`ValidationOptions`), ``[monitors]``
(:class:`MonitorsOptions`) and ``[budget]`` (:class:`BudgetOptions`), all in
:data:`CORE_SECTION_OPTIONS`, and one section per slot (``[model]``, ``[parallelism]``,
``[precision]``, ``[data]``, ``[optimizer]``, ``[lr_schedule]``). A slot section names its plugin
with ``name`` and otherwise belongs to that plugin: its keys are the plugin's options. The core
keeps a few keys of its own in slot sections (:data:`SLOT_CORE_KEYS`, :data:`PRECISION_CHAIN_DOC`);
:func:`clash` refuses a plugin that would take one. Monitors are listed in ``monitors.enabled`` and
each takes its options from ``[monitors.<name>]``. :mod:`core.config.run_config` resolves a config
against these declarations.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Literal

from core.contract.errors import ConfigError
from core.contract.options import fields_of, key_of, option

# Checkpoint folders are step_<9 digits>, sorted by name; step counts and tokens must fit an int64.
MAX_STEPS = 999_999_999
MAX_TOKENS = 2**63 - 1
# The seed reaches random.seed, numpy (mod 2**32), torch.manual_seed and per-step generators
# (seed x 1_000_003 + ...), all of which a 32-bit seed keeps inside torch's 64-bit range.
MAX_SEED = 2**32 - 1
# torch.distributed keeps timeouts in int64 nanoseconds: a rendezvous asked to wait longer than
# about 9.2e9 s "timed out" at once, and past 8.6e13 s datetime.timedelta raised; about three years.
MAX_COLLECTIVE_TIMEOUT_S = 100_000_000


@dataclass
class TrainOptions:
    steps: int = option(0, "optimizer steps to run; 0 derives them from target_tokens", ge=0, le=MAX_STEPS)
    target_tokens: int = option(0, "tokens to train on when steps is 0", ge=0)
    global_batch_tokens: int = option(65536, "tokens per optimizer step, summed over all ranks", gt=0)
    micro_batch: int | Literal["auto"] = option(8, 'sequences per forward pass on each rank, or "auto": the largest that fits', gt=0)
    micro_batch_max: int = option(64, 'with micro_batch = "auto": the largest micro-batch tried (on CPU: the one used)', gt=0)
    seed: int = option(42, "seed for init, data order and dropout", ge=0, le=MAX_SEED)
    output_dir: str = option("runs/default", "folder for the resolved config, metrics and checkpoints")
    log_every: int = option(10, "steps between metric lines (the last step is always logged)", gt=0)
    grad_clip: float = option(1.0, "max global gradient norm; 0 disables clipping", ge=0)
    max_nonfinite_steps: int = option(
        3, "steps in a row with a NaN/inf loss or gradient norm that are skipped (update not applied) before the run stops with exit 3", ge=0
    )
    device: Literal["auto", "cpu", "cuda"] = option("auto", "auto: cuda when available, else cpu")
    deterministic: bool = option(False, "ask torch for deterministic kernels (slower on GPU)")
    activation_checkpointing: Literal["none", "full", "selective"] = option(
        "none", "recompute activations in the backward pass: full blocks, or all but matmul/attention outputs"
    )
    activation_checkpointing_every: int = option(1, "with 'full': checkpoint every n-th block (1 = all)", gt=0)
    compile: bool = option(False, "torch.compile each block, and the loss where the model offers it (compile_loss)")
    collective_timeout_s: int = option(
        1800,
        "seconds a collective waits for the other ranks before the run fails (a hung or stopped rank); leave room for compiles and saves",
        gt=0,
        le=MAX_COLLECTIVE_TIMEOUT_S,
    )
    stall_timeout_s: float = option(
        1800.0,
        "seconds without progress (a step's data read or compute, a monitor call, a validation batch, a save's phase or writes, a checkpoint's reads, teardown) "
        "before a rank ends the run for a restart, naming the rank furthest behind, with every thread's stack (3x until the first step ends); 0: off, else at least 1",
        ge=0,
        le=MAX_COLLECTIVE_TIMEOUT_S,
    )

    def check(self) -> None:
        if self.steps == 0 and self.target_tokens == 0:
            raise ValueError("set steps or target_tokens")
        if 0 < self.stall_timeout_s < 1:  # a run ended as 'stalled' at once, which launchers restart again and again
            raise ValueError(f"stall_timeout_s: expected 0 (off) or at least 1 second, got {self.stall_timeout_s!r}")
        if not self.output_dir.strip():  # e.g. --train.output_dir=$RUN_DIR with RUN_DIR unset: never the working directory
            raise ValueError("output_dir: expected a folder, got an empty string")
        self.output_dir = home_folder(self.output_dir)


def home_folder(folder: str) -> str:
    """``~/runs/x`` is in the home folder, as in path options (no shell expands it inside a TOML file
    or after ``--key=``); plait made a folder named ``~`` in the working directory instead."""
    return os.path.expanduser(folder) if folder.startswith("~") else folder


# The parts of a checkpoint, each of which a resume can leave out (checkpoint.exclude_from_loading).
PARTS = ("model", "optimizer", "lr_schedule", "data", "train", "rng")


@dataclass
class CheckpointOptions:
    every: int = option(0, "steps between checkpoints; 0 saves only at the end and on a stop", ge=0)
    dir: str = option("", "folder of checkpoints; empty means <train.output_dir>/checkpoints")
    async_save: bool = option(False, "write with dcp.async_save while training goes on", key="async")
    keep_latest: int = option(3, "complete checkpoints to keep, older ones are deleted; 0 keeps all", ge=0)
    keep_every: int = option(0, "also keep for good the checkpoint of every step that is a multiple of N; 0: off", ge=0)
    resume: str = option("auto", "'auto' (latest complete checkpoint in dir), 'none', or a checkpoint folder", path=True)
    exclude_from_loading: list[str] = option([], "parts not loaded on resume: model, optimizer, lr_schedule, data, train, rng")
    at_end: bool = option(True, "save when training completes")
    on_stop: bool = option(True, "save when SIGTERM/SIGINT/SIGHUP or a monitor stops the run (unless the monitor says no)")
    keep_best: int = option(
        0,
        "keep the N checkpoints with the best checkpoint.best_metric through pruning: a value in the top N saves its step; <dir>/BEST.json lists them, best first; 0: off",
        ge=0,
    )
    best_metric: str = option("val_loss", "the metric keep_best ranks by: val_loss, or any number every rank logs on a log step (eval/<task>/acc_norm, ...)")
    best_mode: str = option("min", "'min': lower is better (losses, bpb); 'max': higher is better (accuracies)")
    keep_lowest_loss: bool = option(
        True,
        "also keep this run's checkpoint with the lowest training loss, so a loss that rises without reaching NaN never prunes every good one",
    )
    keep_measured: bool = option(
        True,
        "judge checkpoints by the loss the next step measured on their weights: the lowest-loss one by it, and the last sound one kept while newer ones are unmeasured or diverged",
    )
    initial_load: str = option("", "weights to start from when not resuming: a checkpoint folder, a safetensors export or a Hugging Face folder", path=True)
    allow_foreign: bool = option(
        False, "start a fresh run (resume = 'none') in a folder that holds another run's checkpoints; they are left untouched, never pruned"
    )

    def check(self) -> None:
        bad = [p for p in self.exclude_from_loading if p not in PARTS]
        if bad:
            raise ValueError(f"exclude_from_loading: unknown part {bad[0]!r}; parts: {', '.join(PARTS)}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode: expected 'min' or 'max', got {self.best_mode!r}")
        if not self.best_metric.strip():
            raise ValueError("best_metric: expected a metric name (val_loss, eval/<task>/acc_norm, ...), got an empty string")
        if not self.resume.strip():  # e.g. --checkpoint.resume=$CKPT with CKPT unset
            raise ValueError("resume: expected 'auto', 'none' or a checkpoint folder, got an empty string")
        if self.dir.startswith("~"):  # the home folder, as in path options and train.output_dir
            self.dir = os.path.expanduser(self.dir)


@dataclass
class ValidationOptions:
    every: int = option(0, "steps between validation passes; 0 disables validation", ge=0)
    batches: int = option(10, "micro-batches per rank in each validation pass", gt=0)
    split: str = option("val", "the data source's split to evaluate")
    per_source: bool = option(True, "also evaluate each part of a source that has parts (a mixture's sources): val_loss/<label>")


@dataclass
class BudgetOptions:
    force: bool = option(False, "start even when a monitor's pre-flight check (the budget guard's cost projection) refuses")


@dataclass
class MonitorsOptions:
    enabled: list[str] = option(["console", "jsonl", "mfu", "memory", "update_ratio"], "monitor plugins to run, in call order")
    on_error: Literal["stop", "continue"] = option("stop", "a monitor that raises: stop the run cleanly (with a checkpoint), or disable that monitor and go on")


# Keys of slot sections that the core reads itself; the rest go to the plugin.
SLOT_CORE_KEYS: dict[str, dict[str, tuple[Any, Any, str]]] = {
    "data": {
        "seq_len": (int, 256, "tokens per training sequence"),
    },
}

# Listed by `python -m core.plugins`; read by resolve_precision_chain and core.preflight.prepare.
PRECISION_CHAIN_DOC: dict[str, tuple[str, Any, str]] = {
    "fallback": ("list[str]", [], "try these precision plugins in order, use the first supported here (options in [precision.<name>])"),
    "fallback_reasons": ("dict[str, str]", {}, "written by plait in the resolved config: why each skipped entry was unsupported"),
}

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")  # a TOML bare key: one segment of --section.key=value


def clash(slot: str, name: str, options: type) -> str | None:
    """Why component ``name`` of ``slot`` could not be configured (checked when it registers): a name
    that is not a bare TOML key, or one the core reads in the same table (a monitor named like a
    ``[monitors]`` key, a precision named like a chain key), or an option the core reads in its
    slot's section (``name``, ``data.seq_len``...), which the plugin would never receive."""
    if not BARE_KEY.fullmatch(name):
        return f"the name {name!r} is not a bare TOML key (letters, digits, '_' and '-'), so no config could name its section"
    core = {"monitor": [f.name for f in fields_of(MonitorsOptions)], "precision": list(PRECISION_CHAIN_DOC)}.get(slot, [])
    if name in core:
        return f"the name {name!r} is a key the core reads in [{SLOT_SECTIONS.get(slot, 'monitors')}]"
    taken = sorted({key_of(f) for f in fields_of(options)} & {"name", *SLOT_CORE_KEYS.get(slot, {}), *(PRECISION_CHAIN_DOC if slot == "precision" else ())})
    if slot != "monitor" and taken:
        return f"option {taken[0]!r} is a key the core reads in [{SLOT_SECTIONS[slot]}] itself (python -m core.plugins: core key), so the plugin would never receive it"
    return None


SLOT_SECTIONS: dict[str, str] = {
    "model": "model",
    "parallelism": "parallelism",
    "precision": "precision",
    "data": "data",
    "optimizer": "optimizer",
    "lr_schedule": "lr_schedule",
}

DEFAULT_PLUGIN: dict[str, str | None] = {
    "model": None,  # required
    "parallelism": "ddp",
    "precision": "fp32",
    "data": None,
    "optimizer": "adamw",
    "lr_schedule": "warmup_cosine",
}

CORE_SECTIONS = ("train", "monitors")


# Core sections besides [train] and [monitors], by name.
EXTRA_SECTIONS: dict[str, type] = {"checkpoint": CheckpointOptions, "validation": ValidationOptions, "budget": BudgetOptions}

CORE_SECTION_OPTIONS: dict[str, type] = {"train": TrainOptions, "monitors": MonitorsOptions, **EXTRA_SECTIONS}


def micro_batch_candidates(global_batch_tokens: int, seq_len: int, world_size: int, ceiling: int) -> list[int]:
    """The micro-batches ``m <= ceiling`` for which ``global_batch_tokens`` divides by
    ``m x seq_len x world_size``, largest first (``train.micro_batch = "auto"``)."""
    per_rank_seqs = global_batch_tokens // (seq_len * world_size) if global_batch_tokens % (seq_len * world_size) == 0 else 0
    out = [m for m in range(min(ceiling, per_rank_seqs), 0, -1) if per_rank_seqs % m == 0]
    if not out:
        raise ConfigError(
            f'train.micro_batch = "auto": train.global_batch_tokens = {global_batch_tokens} is not divisible by '
            f"data.seq_len ({seq_len}) x world size ({world_size})"
        )
    return out


def batch_layout(global_batch_tokens: int, micro_batch: int, seq_len: int, world_size: int) -> int:
    """Accumulation steps so that micro_batch x seq_len x world_size x accum == global_batch_tokens."""
    per_pass = micro_batch * seq_len * world_size
    if global_batch_tokens % per_pass != 0:
        raise ConfigError(
            f"train.global_batch_tokens = {global_batch_tokens} is not divisible by "
            f"train.micro_batch ({micro_batch}) x data.seq_len ({seq_len}) x world size ({world_size}) = {per_pass}; "
            f"try global_batch_tokens = {max(1, round(global_batch_tokens / per_pass)) * per_pass}"
        )
    return global_batch_tokens // per_pass


def total_steps(train: TrainOptions, tokens_per_step: int) -> int:
    steps = train.steps or -(-train.target_tokens // tokens_per_step)
    if steps > MAX_STEPS:
        raise ConfigError(
            f"[train].target_tokens = {train.target_tokens} needs {steps} steps of {tokens_per_step} tokens; "
            f"expected at most {MAX_STEPS} steps (checkpoint folders count steps in 9 digits)"
        )
    if steps * tokens_per_step > MAX_TOKENS:
        raise ConfigError(f"[train] {steps} steps x {tokens_per_step} tokens overflow the 64-bit token counter; expected at most {MAX_TOKENS} tokens")
    return steps


def data_ranks(dp: int, world: int, tp: int, pp: int = 1) -> str:
    """The ranks that read different batches, said in a batch line: ``4 ranks``, or with tensor or
    pipeline parallelism ``2 data-parallel ranks (4 ranks, tp 2)``, ``... (4 ranks, pp 2)``."""
    if tp == 1 and pp == 1:
        return f"{world} ranks"
    degrees = (f", tp {tp}" if tp > 1 else "") + (f", pp {pp}" if pp > 1 else "")
    return f"{dp} data-parallel ranks ({world} ranks{degrees})"
