"""From a config file to checked, instantiated components: everything before a process group.

``prepare`` is shared by ``core.train`` and ``core.plan``: it reads the TOML,
loads the plugins, validates every option, derives the batch layout and runs
each plugin's pre-flight checks, checks the data and the checkpoint to resume
from, and probes that the output and checkpoint folders can be created and
written (:mod:`core.preflight.start_folders`: bad input leaves no folder behind). Any
problem is a :class:`PlaitError`.
"""

from __future__ import annotations

import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from core.checkpoint import run_architecture
from core.config import files as config_io
from core.config import registry as registry_mod
from core.config.registry import plugin_manager
from core.config.run_config import RunConfig, resolve
from core.config.sections import batch_layout, micro_batch_candidates, total_steps
from core.contract import log, mup
from core.contract.errors import CheckpointError, ConfigError, DataError, PlaitError, PluginError
from core.contract.hookspecs import register_monitor
from core.contract.members import check_component, member
from core.contract.protocols import LoaderSpec
from core.contract.run import PreparedRun
from core.data.tokenizer_spec import data_end_of_document_id, declared_tokenizer
from core.preflight.pipeline_checks import check_pipeline, check_pipeline_micro_batches
from core.preflight.plugin_checks import build_meta, call_plugin, check_data, check_first_step, check_model_answers, check_unchanged
from core.preflight.start_folders import check_start
from core.runtime.distributed import env_world, pick_device


@dataclass
class Prepared:
    """A run ready to start: config, components, and the numbers derived from them."""

    source: str
    raw: dict[str, Any]
    rc: RunConfig
    components: dict[str, Any]  # slot -> instance
    world_size: int
    device: torch.device
    grad_accum: int
    tokens_per_step: int
    total_steps: int
    resume_candidates: list[Path] = field(default_factory=list)  # checkpoints to try, best first (core.checkpoint.resume)
    passed_over: str = ""  # why resume = "auto" passed over newer sound checkpoints (after a diverged attempt)
    micro_batch_candidates: list[int] = field(default_factory=list)  # train.micro_batch = "auto"
    seq_len_schedule: list[tuple[int, int]] = field(default_factory=list)  # (first_step, seq_len): plait_seq_len_schedule
    model_meta: torch.nn.Module | None = None  # the model built on the meta device for the checks (core.plan sizes it)
    architecture: dict[str, Any] | None = None  # model name and declared architecture options (core.checkpoint.folders)
    tokenizer: dict[str, Any] | None = None  # the data source's declared tokenizer (core.data.tokenizer_spec)
    tensor_parallel: int = 1  # ranks of one tensor-parallel group (the parallelism's tensor_parallel)
    monitor_hooks: Any = None  # the enabled monitors' pluggy manager, after their plait_preflight (core.plan asks plait_planned_evaluation)
    pipeline_parallel: int = 1  # pipeline stages (the parallelism's pipeline_parallel)

    @property
    def saved_facts(self) -> dict[str, Any]:
        """What every checkpoint's state.json records beside the state: read by export, generate and resume."""
        return {"architecture": self.architecture, "tokenizer": self.tokenizer}

    @property
    def checkpoint_root(self) -> Path:
        return checkpoint_root(self.rc)

    @property
    def resume_from(self) -> Path | None:
        """The checkpoint a resume tries first."""
        return self.resume_candidates[0] if self.resume_candidates else None

    @property
    def spec(self):
        return self.components["model"]

    def for_monitors(self) -> PreparedRun:
        """What ``plait_preflight`` receives."""
        return PreparedRun(self.world_size, self.device, self.grad_accum, self.tokens_per_step, self.total_steps, self.resolved, self.spec, self.tokenizer)

    @property
    def resolved(self) -> dict[str, Any]:
        out = self.rc.to_dict()
        out["derived"] = {"grad_accum": self.grad_accum, "world_size": self.world_size}  # for the reader; ignored when read
        # The output folders as absolute paths, as path options are: config.resolved.toml re-runs the same
        # run from any working directory (its own folder included), never a fresh one in a folder beside it.
        out["train"]["output_dir"] = os.path.abspath(out["train"]["output_dir"])
        if out.get("checkpoint", {}).get("dir"):
            out["checkpoint"]["dir"] = os.path.abspath(out["checkpoint"]["dir"])
        return out


def prepare(
    path: str,
    overrides: list[str] | None = None,
    world_size: int | None = None,
    validate_data: bool = True,
    dry_run: bool = False,
    lock: bool = False,
    problems: list[PlaitError] | None = None,
    node_size: int | None = None,
) -> Prepared:
    """``validate_data``: check the data, the resume checkpoint and the output folders (what
    ``core.train`` and ``core.plan`` do). ``dry_run`` (``core.plan``): the folder probe removes
    the folders it created instead of leaving them for the run. ``lock`` (``core.train``'s rank 0):
    own the run folders (:func:`core.runtime.ownership.lock_run_folders`) before listing the
    checkpoints to resume from. ``problems`` (``core.plan``): a missing or unusable data file or
    checkpoint (``DataError``, ``CheckpointError``) found by the data, monitor and folder checks is
    appended there and the preparation goes on, so that the plan can still be made; any other
    problem is raised."""
    raw = config_io.load(path, overrides)
    registry = registry_mod.load()
    try:
        rc = resolve(raw, registry, source=str(path))
    except ConfigError as e:  # a value from the command line is not in the file the line names
        named = r"\[{0}\]( \([^)]*\))?(\.{1}:|: unknown key '{1}')"  # [optimizer].lr: or [optimizer] (optimizer 'adamw').lr:
        given = [k for k, _ in config_io.parse_overrides(overrides or []) if re.search(named.format(*map(re.escape, k.rsplit(".", 1))), str(e))]
        raise ConfigError(f"{e} (given on the command line: --{given[0]})" if given else str(e)) from None
    components = {slot: chosen.instantiate() for slot, chosen in rc.slots.items()}
    for slot, component in components.items():  # what each factory returned, held to core/contract/members.py
        check_component(slot, rc.slots[slot].component.name, component)
    mup.check_asked(components["model"], rc.slots["model"].component.name, rc.to_dict()["model"], str(path))
    _, env_world_size, local_rank = env_world()
    world = world_size or env_world_size
    device = pick_device(rc.train.device, local_rank)
    if rc.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f'{path}: [train].device = "cuda" but torch sees no CUDA device')

    check_world = member("parallelism", components["parallelism"], "check_world")
    if check_world is not None:
        call_plugin(f"parallelism {rc.slots['parallelism'].component.name!r}: check_world", check_world, world)
    node = node_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks on one node: torchrun's, or the whole world
    tp = check_tensor_parallel(components, rc, node, str(path))
    check_expert_parallel(components, rc, str(path))
    pp = check_pipeline(components, rc, str(path))
    dp_world = world // (tp * pp)  # the ranks that read different batches
    monitors = [(chosen.component.name, chosen.instantiate()) for chosen in rc.monitors]
    pm = plugin_manager()  # the hook contract of every monitor; nothing stays registered
    for name, monitor in monitors:
        register_monitor(pm, name, monitor)
    steps = total_steps(rc.train, rc.train.global_batch_tokens)
    schedule = seq_len_schedule(pm, [name for name, _ in monitors], rc, steps, str(path))
    micro_auto: list[int] = []
    if rc.train.micro_batch == "auto":
        micro_auto = micro_batch_candidates(rc.train.global_batch_tokens, rc.seq_len, dp_world, rc.train.micro_batch_max)
        rc.train.micro_batch = micro_auto[0]  # CUDA: the trainer probes down from here
    accum = batch_layout(rc.train.global_batch_tokens, rc.train.micro_batch, rc.seq_len, dp_world)
    check_pipeline_micro_batches(components["parallelism"], pp, accum, str(path))
    warn_if_lr_never_peaks(components["lr_schedule"], steps, rc.slots["lr_schedule"].component.name)

    precision = choose_precision(rc, components, device, str(path))
    spec, model_name = components["model"], rc.slots["model"].component.name
    tell_end_of_document(spec, model_name, components["data"], rc.slots["data"].component.name, str(path))
    architecture = call_plugin(f"model {model_name!r}: resolved_architecture", run_architecture, spec, model_name, rc.to_dict()["model"])  # another is refused
    check_model_answers(spec, model_name, rc.train.micro_batch, rc.seq_len)
    model_meta = build_meta(spec, model_name)  # once, for every check below; precision conversions keep parameter names
    check_model = member("precision", precision, "check_model")
    if check_model is not None:
        check_unchanged(f"precision {rc.slots['precision'].component.name!r}: check_model", check_model, model_meta)

    max_seq = member("model", spec, "max_seq_len")
    longest = max([rc.seq_len] + [seq for _, seq in schedule])
    if max_seq is not None and longest > max_seq:
        what = "data.seq_len" if longest == rc.seq_len else "the sequence-length schedule's length"
        raise ConfigError(f"{path}: {what} {longest} exceeds the model's max_seq_len {max_seq}")
    if validate_data and not dry_run and device.type == "cpu":
        check_host_memory(model_meta, world if member("parallelism", components["parallelism"], "shards_parameters") else 1, str(path))
    if validate_data:
        val = rc.sections["validation"]
        seq = next((s for first, s in schedule if first == 0), rc.seq_len)  # the first step's length (a stage from step 0)
        tokens = rc.train.micro_batch * rc.seq_len
        first = LoaderSpec(seq, tokens // seq, accum, 0, dp_world, rc.train.seed, total_samples=steps * rc.train.global_batch_tokens // rc.seq_len)
        with noted(problems):
            check_data(components["data"], rc.slots["data"].component.name, spec.vocab_size, rc.seq_len, val.every, val.split, str(path))
            check_first_step(components["data"], rc.slots["data"].component.name, first)
    prep = Prepared(str(path), raw, rc, components, world, device, accum, rc.train.global_batch_tokens, steps)
    prep.micro_batch_candidates = micro_auto
    prep.tensor_parallel = tp
    prep.pipeline_parallel = pp
    prep.model_meta = model_meta
    prep.architecture = architecture
    data_name = f"data {rc.slots['data'].component.name!r}"
    with noted(problems):
        prep.tokenizer = call_plugin(f"{data_name}: tokenizer", declared_tokenizer, components["data"], data_name)  # recorded in checkpoints
    prep.seq_len_schedule = schedule
    args = {"prep": prep.for_monitors(), "force": rc.sections["budget"].force}
    for impl in reversed(pm.hook.plait_preflight.get_hookimpls()):  # monitors' own checks (the budget guard's projection)
        with noted(problems):
            call_plugin(f"monitor {impl.plugin_name!r}: plait_preflight", impl.function, **{k: args[k] for k in impl.argnames})
    prep.monitor_hooks = pm
    if validate_data:  # a training start: the folders, the checkpoint to resume from (core.preflight.start_folders)
        with noted(problems):
            check_start(prep, model_meta, lock, dry_run)
        if (resumed := steps_to_target(prep)) != prep.total_steps:
            prep.total_steps = resumed
            prep.seq_len_schedule = seq_len_schedule(pm, [name for name, _ in monitors], rc, resumed, str(path))
    return prep


@contextmanager
def noted(problems: list[PlaitError] | None) -> Iterator[None]:
    """Inside: a ``DataError`` or ``CheckpointError`` goes to ``problems`` (when given) instead of
    up; the rest of the block is skipped."""
    try:
        yield
    except (DataError, CheckpointError) as e:
        if problems is None:
            raise
        problems.append(e)


def check_tensor_parallel(components: dict[str, Any], rc: RunConfig, node_size: int, path: str) -> int:
    """The parallelism's tensor-parallel degree, once the node size, the model, the precision, compile with
    full activation checkpointing and the sequence length can take it: ConfigError (one line) before any process
    group otherwise."""
    tp = member("parallelism", components["parallelism"], "tensor_parallel")
    if tp == 1:
        return 1
    model_name, precision_name = rc.slots["model"].component.name, rc.slots["precision"].component.name
    where = f"{path}: [parallelism] tp = {tp}"
    if node_size % tp:
        raise ConfigError(
            f"{where} does not divide the {node_size} ranks of a node; expected a divisor of the ranks per node (a tensor-parallel group "
            "talks every layer: it stays within one node's links)"
        )
    check = member("model", components["model"], "check_tensor_parallel")
    if check is None:
        raise ConfigError(f"{where}: model {model_name!r} has no tensor-parallel plan (parallelize_tensor); expected tp = 1")
    call_plugin(f"model {model_name!r}: check_tensor_parallel", check, tp)
    check_precision = member("precision", components["precision"], "check_tensor_parallel")
    if check_precision is not None:
        try:
            call_plugin(f"precision {precision_name!r}: check_tensor_parallel", check_precision, tp)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    if rc.train.compile and rc.train.activation_checkpointing == "full":
        raise ConfigError(
            f"{where}: train.compile with full activation checkpointing under tensor parallelism is not supported (torch "
            f"{torch.__version__.split('+')[0]}: AOTAutograd's save_from_forward finds a DeviceMesh among a checkpointed DTensor block's "
            'saved tensors); expected activation_checkpointing = "selective" or "none", or compile = false'
        )
    if rc.train.micro_batch == "auto":
        raise ConfigError(
            f'{where}: train.micro_batch = "auto" with tensor parallelism is not supported yet (its probe runs outside loss_parallel); expected a number'
        )
    if rc.seq_len % tp:
        raise ConfigError(f"{where}: data.seq_len {rc.seq_len} is not divisible by tp (sequence parallelism splits it); expected a multiple of {tp}")
    return tp


def tell_end_of_document(spec: Any, model_name: str, data: Any, data_name: str, path: str) -> None:
    """Give the model spec's optional ``use_end_of_document_id`` the data's end-of-document id, before
    the model is built; its refusal (a document mask without such an id) names the data source."""
    tell = member("model", spec, "use_end_of_document_id")
    if tell is None:
        return
    who = f"data {data_name!r}"
    eod = call_plugin(f"{who}: end_of_document_id", data_end_of_document_id, data, who)
    try:
        call_plugin(f"model {model_name!r}: use_end_of_document_id", tell, eod)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e} ({who})") from None


def steps_to_target(prep: Prepared) -> int:
    """The run's length in steps. ``train.target_tokens`` counts tokens: a resume whose tokens per step
    changed (``train.global_batch_tokens``) ends at the checkpoint's step plus the steps the tokens
    still to go take at this batch. (``target_tokens`` over the new batch alone ended a run resumed at
    4x the batch halfway, "nothing to train", and overshot one resumed at a smaller batch.)"""
    import json

    from core.checkpoint import STATE_FILE

    train, opts = prep.rc.train, prep.rc.sections["checkpoint"]
    if train.steps or prep.resume_from is None or "train" in opts.exclude_from_loading:
        return prep.total_steps
    state = json.loads((prep.resume_from / STATE_FILE).read_text())  # checked by find_resume
    step, seen = int(state["step"]), int(state["tokens_seen"])
    return max(step, step + -(-(train.target_tokens - seen) // prep.tokens_per_step))


def check_host_memory(model_meta: torch.nn.Module, shards: int, path: str) -> None:
    """On CPU: refuse a model whose fp32 weights and gradients alone exceed this machine's memory
    (a vocab_size or width typed a thousand times too large), which would otherwise fail with an
    allocation traceback after the process group is up, and again at every restart."""
    numel = sum(p.numel() for p in {id(p): p for p in model_meta.parameters()}.values())
    need = 8 * numel / shards
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX machine that says
        return
    if need > have:
        raise ConfigError(
            f"{path}: the model's {numel:,} parameters need {need / 2**30:,.1f} GiB per rank for fp32 weights and gradients alone; "
            f"this machine has {have / 2**30:,.1f} GiB of memory"
        )


def warn_if_lr_never_peaks(schedule: Any, steps: int, name: str) -> None:
    """A schedule whose multiplier never reaches 1 in this run (warmup at or beyond the run's end)."""
    stride = max(1, steps // 2000)
    values = []
    for s in [*range(0, steps - 1, stride), steps - 1]:
        m = call_plugin(f"lr_schedule {name!r}: multiplier", schedule.multiplier, s, steps)
        if not isinstance(m, (int, float)) or isinstance(m, bool) or not 0 <= m < math.inf:
            raise PluginError(f"[lr_schedule] {name!r}: multiplier({s}, {steps}) returned {m!r}; expected a finite number >= 0")
        values.append(m)
    peak = max(values, default=1.0)
    still_rising = bool(values) and values[-1] >= peak and len(values) > 1 and values[-1] > values[0]
    if peak < 0.999 and still_rising and env_world()[0] == 0:  # the warmup outlasts the run
        log.warn(
            f"[lr_schedule] {name}: the learning rate never reaches its peak in this run's {steps} "
            f"steps (highest multiplier {peak:.3g}): is the warmup at or beyond the run's end?"
        )


def supported(precision: Any, name: str, device: torch.device) -> tuple[bool, str]:
    """The precision plugin's ``supported(device)``, held to its declared shape ``(ok, reason)``."""
    answer = call_plugin(f"precision {name!r}: supported", precision.supported, device)
    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool) and isinstance(answer[1], str)):
        raise PluginError(f"precision {name!r}: supported({device.type!r}) returned {answer!r}; expected (ok: bool, reason: str)")
    return answer


def choose_precision(rc: RunConfig, components: dict[str, Any], device: torch.device, path: str) -> Any:
    """The precision to use: the configured one, or the first supported entry of ``precision.fallback``.

    Every rank asks the same question of the same kind of device, so every
    rank gets the same answer; the trainer checks that they agree.
    """
    if not rc.precision_chain:
        precision = components["precision"]
        ok, why = supported(precision, rc.slots["precision"].component.name, device)
        if not ok:
            raise ConfigError(f"{path}: [precision] {precision.name!r} is not supported here: {why}")
        return precision
    reasons: dict[str, str] = {}
    for chosen in rc.precision_chain:
        precision = chosen.instantiate()
        check_component("precision", chosen.component.name, precision)
        ok, why = supported(precision, chosen.component.name, device)
        if ok:
            rc.slots["precision"] = chosen
            rc.precision_reasons = reasons
            components["precision"] = precision
            skipped = "; ".join(f"{k}: {v}" for k, v in reasons.items()) or "nothing skipped"
            log.note(f"precision fallback chose {chosen.component.name!r} ({skipped})")
            return precision
        reasons[chosen.component.name] = why
    raise ConfigError(
        f"{path}: [precision] nothing in fallback = {[c.component.name for c in rc.precision_chain]} is supported here: "
        + "; ".join(f"{k}: {v}" for k, v in reasons.items())
    )


def seq_len_schedule(pm: Any, order: list[str], rc: RunConfig, steps: int, path: str) -> list[tuple[int, int]]:
    """The run's sequence-length schedule from the first monitor (in config order) whose
    ``plait_seq_len_schedule`` returns one, checked: rising steps, lengths that divide the
    micro-batch's tokens. ``[]``: ``data.seq_len`` throughout."""
    impls = {impl.plugin_name: impl for impl in pm.hook.plait_seq_len_schedule.get_hookimpls()}
    args = {"seq_len": rc.seq_len, "total_steps": steps}
    for name in [n for n in order if n in impls]:
        try:
            schedule = impls[name].function(**{k: args[k] for k in impls[name].argnames})
        except PlaitError:
            raise
        except Exception as e:
            raise PluginError(f"monitor {name!r}: plait_seq_len_schedule failed: {type(e).__name__}: {e}") from None
        if schedule is None:
            continue
        where = f"{path}: monitor {name!r}: sequence-length schedule"
        pairs = [tuple(p) for p in schedule] if isinstance(schedule, list) else None
        if pairs is None or any(len(p) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in p) for p in pairs):
            raise PluginError(f"{where}: expected a list of (first_step, seq_len) integer pairs, got {schedule!r}")
        firsts = [first for first, _ in pairs]
        if firsts != sorted(set(firsts)) or (firsts and (firsts[0] < 0 or firsts[-1] > steps)):
            raise PluginError(f"{where}: first steps must rise within 0..{steps}; got {firsts}")
        if pairs and rc.train.micro_batch == "auto":
            raise ConfigError(f'{where} needs a fixed train.micro_batch, not "auto"')
        tokens = rc.train.micro_batch * rc.seq_len
        for _, seq in pairs:
            if seq <= 0 or tokens % seq:
                raise ConfigError(
                    f"{where}: sequence length {seq} does not divide the micro-batch's {tokens} tokens "
                    f"(train.micro_batch {rc.train.micro_batch} x data.seq_len {rc.seq_len})"
                )
        return [(int(first), int(seq)) for first, seq in pairs]
    return []


def checkpoint_root(rc: RunConfig) -> Path:
    opts = rc.sections["checkpoint"]
    return Path(opts.dir) if opts.dir else Path(rc.train.output_dir) / "checkpoints"


def check_expert_parallel(components: dict[str, Any], rc: RunConfig, path: str) -> None:
    """The parallelism's expert-parallel degree, once the model can split its experts into it:
    ConfigError (one line) before any process group otherwise."""
    ep = member("parallelism", components["parallelism"], "expert_parallel")
    if ep == 1:
        return
    model_name = rc.slots["model"].component.name
    where = f"{path}: [parallelism] ep = {ep}"
    check = member("model", components["model"], "check_expert_parallel")
    if check is None:
        raise ConfigError(f"{where}: model {model_name!r} declares no experts (parallelize_experts); expected ep = 1")
    call_plugin(f"model {model_name!r}: check_expert_parallel", check, ep)
    if rc.train.micro_batch == "auto":
        raise ConfigError(f'{where}: train.micro_batch = "auto" with expert parallelism is not supported yet; expected a number')
