"""Everything the core reads from a plugin's object, declared once, and the check that holds a plugin to it.

:data:`CONTRACT` lists, for each slot, every member the core reads from the object a component's
factory returns: the **required** ones (which :mod:`core.contract.protocols` types for authors and
mypy; ``tests/unit/contract/test_api.py`` holds the two to the same names) and the **optional** ones with what
the core does without them (the default column; a value's ``default`` is what the core reads).
:data:`MADE` does the same for the objects those make and the core reads: the data source's loader
and the model spec's built module.

Three things read this one declaration: :func:`check_component` runs on every component a config
names, before any process group or model exists, and refuses a missing required member or a
malformed one with one line naming the plugin, the member and what was expected; :func:`member` is
the one way the core reads a member (with the declared default; a name not declared for the slot
is a KeyError, so nothing undeclared is ever looked up); ``python -m core.plugins --contract``
prints :func:`describe_contract`.

One rule for optional members, every reader held to it: set to None is absent (the core does
what the default column says), as if left out.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from core.contract.errors import PluginError


@dataclass(frozen=True)
class Member:
    name: str
    kind: str  # "method" (with ``params`` positional parameters) or "value" (of ``types``)
    doc: str
    required: bool = True
    params: int = 0
    types: tuple[type, ...] = ()
    needs: str = ""  # another member of the slot that a plugin providing this one must provide too
    default: Any = None  # what the core reads when an optional member is absent (or None)

    def describe(self) -> str:
        what = f"method, {self.params} argument(s)" if self.kind == "method" else f"value ({' | '.join(t.__name__ for t in self.types)})"
        return f"{self.name}: {what}{'' if self.required else ', optional'}{f', needs {self.needs}' if self.needs else ''}: {self.doc}"


def method(name: str, params: int, doc: str, required: bool = True, needs: str = "") -> Member:
    """A method taking ``params`` positional arguments; an optional one absent reads as None."""
    return Member(name, "method", doc, required, params, needs=needs)


def value(name: str, types: tuple[type, ...], doc: str, required: bool = True, default: Any = None) -> Member:
    """A value of one of ``types``; an optional one absent (or None) reads as ``default``."""
    return Member(name, "value", doc, required, types=types, default=default)


CONTRACT: dict[str, list[Member]] = {
    "model": [
        value("vocab_size", (int,), "vocabulary size; every token id of the data is below it"),
        method("build", 0, "the nn.Module, built under torch.device('meta'); forward(ids, labels) -> mean loss"),
        method("init_weights", 1, "initialize the materialized module in place"),
        method("blocks", 1, "the repeated blocks: units of sharding, checkpointing and compile"),
        method("flops_per_token", 1, "training FLOPs per token at seq_len (docs/metrics.md)"),
        method("activation_bytes", 3, "activation memory of one micro-batch (micro_batch, seq_len, bytes_per_element)"),
        method(
            "high_precision_modules",
            1,
            "(model) -> names of modules precision plugins leave in high precision; default: the linears mapping to the vocabulary (the output head)",
            False,
        ),
        method("compile_loss", 1, "(model) with train.compile, compile the loss too (output layer + cross-entropy); default: only the blocks", False),
        method(
            "param_counts",
            0,
            "(total, non_embedding) parameter counts without building (non_embedding: no embedding, no output head); default: counted on a meta build",
            False,
        ),
        value("max_seq_len", (int,), "longest sequence the model takes; longer data.seq_len is refused; default: unchecked", False),
        method("to_hf_state_dict", 1, "plait state dict -> Hugging Face names (core.export --format hf); default: no hf export", False, needs="hf_config"),
        method("from_hf_state_dict", 1, "Hugging Face state dict -> plait names (initial_load of an HF folder); default: HF folders are refused", False),
        method(
            "hf_config",
            0,
            "the Hugging Face config.json dict written by export: its architectures decide the loading class; default: none (needed with to_hf_state_dict)",
            False,
        ),
        value(
            "architecture_options",
            (tuple,),
            "names of its [model] options that define the function its weights compute, not those a run may change on purpose "
            "(rope_theta, max_seq_len); a resume or initial_load of a checkpoint saved with other values is refused; default: shapes only",
            False,
        ),
        method(
            "use_end_of_document_id",
            1,
            "(the data's end-of-document id, or None) told before build, for a document attention mask; refuse None when needed (raise ConfigError); default: not told",
            False,
        ),
        method(
            "check_tensor_parallel",
            1,
            "(tp) refuse a tensor-parallel degree its shapes or options cannot split into (raise ConfigError); default: tp > 1 refused",
            False,
            needs="parallelize_tensor",
        ),
        method(
            "parallelize_tensor",
            2,
            "(model, tp_mesh) shard its modules over the 1-D tensor-parallel mesh (parallelize_module); default: tp > 1 refused",
            False,
            needs="check_tensor_parallel",
        ),
        method(
            "check_pipeline",
            1,
            "(n_stages) refuse a pipeline stage count its layers or options cannot split into (raise ConfigError); default: pp > 1 refused",
            False,
            needs="pipeline_stages",
        ),
        method(
            "pipeline_stages",
            3,
            "(model, stage_ids, n_stages) -> the modules of those pipeline stages, model pruned to them (embedding first, head last, "
            "blocks split evenly; forward(h=None, *, tokens, labels)); default: pp > 1 refused",
            False,
            needs="check_pipeline",
        ),
        method(
            "tensor_parallel_costs",
            4,
            "(tp, micro_batch, seq_len, bytes_per_element) -> {whole_params: parameters every tp rank holds whole, activation_bytes: one "
            "micro-batch's activations on one rank, comm_bytes: what one rank sends in tp collectives for one micro-batch, forward and backward} "
            "(core.plan); default: every parameter split, activations / tp, communication not estimated",
            False,
        ),
        method(
            "block_passes",
            1,
            "(model) -> the block applications of one forward of model, pruned or whole (a looped block counts once per loop): "
            "a pipeline rank's share of the activations in core.plan; default: len(blocks(model))",
            False,
        ),
        method(
            "check_expert_parallel",
            1,
            "(ep) refuse an expert-parallel degree its experts or options cannot split into (raise ConfigError); default: ep > 1 refused",
            False,
            needs="parallelize_experts",
        ),
        method(
            "parallelize_experts",
            2,
            "(model, ep_mesh) keep each rank's share of the experts over the expert-parallel mesh (1-D ep; ep x tp under tp > 1: "
            "replicated over tp), routed rows exchanged with all_to_all_single over ep; returns the expert modules (their parameters "
            "are the experts'); default: ep > 1 refused",
            False,
            needs="check_expert_parallel",
        ),
        method(
            "expert_parallel_costs",
            4,
            "(ep, micro_batch, seq_len, bytes_per_element) -> {expert_params: the experts' parameters, all layers (ep splits them, FSDP "
            "shards each rank's part over the replicas), comm_bytes: what one rank sends in all-to-alls for one micro-batch, forward and backward} "
            "(core.plan); default: every parameter FSDP-sharded, all-to-all not estimated",
            False,
        ),
        method("resolved_architecture", 0, "{name: value} as built, flavor resolved, resumes compare it; default: as written", False, "architecture_options"),
        method(
            "mup_widths",
            0,
            '() -> (width, base_width) under [model] parametrization = "mup" (the core scales each kind\'s LR, core.contract.mup), None under standard; '
            "default: no µP (asking for it is refused)",
            False,
        ),
    ],
    "parallelism": [
        method("wrap", 4, "(model, spec, dist, precision) -> the module to call"),
        method("sync_context", 2, "(model, sync) -> context for one micro-step's backward"),
        method("clip_grad_norm", 2, "(model, max_norm) -> the global gradient norm tensor before clipping; the gradients are clipped in place"),
        method("check_world", 1, "refuse a world size it cannot use (raise ConfigError); default: any", False),
        value("shards_parameters", (bool,), "parameters are sharded over ranks (plan's memory estimate); default False", False, default=False),
        value("tensor_parallel", (int,), "ranks of one tensor-parallel group (data-parallel ranks: world size / it); default 1", False, default=1),
        value("pipeline_parallel", (int,), "pipeline-parallel degree (data-parallel ranks: world size / (tp x it)); default 1", False, default=1),
        value("pipeline_stages_per_rank", (int,), "pipeline stages each rank holds (2 for an interleaved schedule); default 1", False, default=1),
        method(
            "pipeline_step",
            2,
            "(model, micro_batches) -> the step's mean loss on every rank: forward and backward of the step's [(inputs, labels)] "
            "through the pipeline schedule, replacing the micro-batch loop; default: the micro-batch loop (pipeline_parallel must be 1)",
            False,
        ),
        method("check_micro_batches", 1, "(micro-batches per step) refuse a count its pipeline schedule cannot run (raise ConfigError); default: any", False),
        value(
            "expert_parallel",
            (int,),
            "ranks of one expert-parallel group, taken from the data-parallel ranks (they read different batches); default 1",
            False,
            default=1,
        ),
        method("shard_tensors", 3, "(model, spec, dist) tensor-parallel sharding, before checkpointing and compile; default: none", False),
        value("wraps_before_compile", (bool,), "wrap before torch.compile instead of after (DDP); default False", False, default=False),
    ],
    "precision": [
        value("name", (str,), "the plugin's name"),
        method("supported", 1, "(device) -> (ok, reason)"),
        method("convert", 2, "(model, spec) -> the model with converted modules"),
        method("autocast", 1, "(device) -> context around each forward"),
        value("param_dtype", (type(None), torch.dtype), "dtype sharded parallelisms compute in, or None"),
        method("metrics", 1, "(model) -> health metrics for log steps"),
        method("check_model", 1, "(meta model, read only) refuse a model it cannot convert (raise ConfigError); default: none", False),
        method("post_optimizer_step", 1, "(model) work after each optimizer step (fp8 scale precompute); default: none", False),
        method("log_step", 1, "(on) the coming step is (True) or is not a log step: record fp8 forward/backward amax for metrics; default: none", False),
        method(
            "check_tensor_parallel",
            1,
            "(tp > 1) refuse tensor parallelism its converted modules cannot run under (raise ConfigError, naming what is supported); default: any tp",
            False,
        ),
    ],
    "data": [
        method("validate", 2, "(vocab_size, seq_len) check files and ids before anything is built"),
        method("loader", 1, "(LoaderSpec) -> the loader (core.contract.protocols.DataLoaderLike)"),
        method("has_split", 1, "(split) whether a validation split exists; default: assumed", False),
        method("check_resume", 2, "(checkpoint state.json, world size) refuse a resume it cannot serve; default: any resume", False),
        method("metrics", 1, "(consumed_samples) data metrics for log steps (mixture shares); default: none", False),
        method("tokens_per_epoch", 0, "tokens in one pass over the training split, or None if unknown (the logged epoch); default: unknown", False),
        method(
            "fingerprint",
            0,
            "a short string that changes when the training data does; saved in checkpoints, a resume on other data warns; default: none",
            False,
        ),
        method(
            "validation_loaders",
            1,
            "(validation LoaderSpec) -> {label: loader}: each part's validation batches, logged as val_loss/<label> (mixture sources); default: val_loss only",
            False,
        ),
        method("check_first_step", 1, "(train LoaderSpec of rank 0) refuse data that cannot serve one step (raise DataError); default: unchecked", False),
        method("tokenizer", 0, "a core.api.TokenizerSpec or None, saved in checkpoints for core.export; default: from [data] (tokenizer, meta.json)", False),
        method(
            "end_of_document_id",
            0,
            "the token id that ends each document of its packed samples, or None (not marked); a document mask needs it; default: its tokenizer()'s eos_id",
            False,
        ),
        method("parts", 0, "{label: source}: the sources it is made of (a mixture); the ones lacking a validation split are named; default: none", False),
        value(
            "samples_before_loader",
            (bool,),
            "an IndexedSource's sample() answers before loader() is called, so the first sample is checked at start (False: a stream inside); default True",
            False,
            default=True,
        ),
    ],
    "optimizer": [
        method("build", 1, "(param_groups) -> torch.optim.Optimizer"),
        value("options", (object,), "its options, an OptimizerOptions subclass (lr, weight_decay, no_decay, lr_multipliers)"),
        value("state_bytes_per_param", (int, float), "optimizer state bytes per parameter (plan, micro_batch auto); default 8", False, default=8),
        value(
            "separate_output_head",
            (bool,),
            "True: the untied output head gets its own group of kind 'output'; default False: a matrix",
            False,
            default=False,
        ),
        value(
            "mup_matrix_lr_power",
            (int, float),
            "under µP the matrix LR is multiplied by (base_width / width) ** this: 1 for entrywise-normalized updates (Adam), 0 for spectral ones (Muon); default 1",
            False,
            default=1.0,
        ),
    ],
    "lr_schedule": [
        method("multiplier", 2, "(step, total_steps) -> multiplier of the peak learning rate"),
    ],
}


# Members of the objects a plugin's component makes, which the core reads too: the data source's
# loader (core.contract.protocols.DataLoaderLike) and the model spec's built module.
MADE: dict[str, list[Member]] = {
    "loader": [
        method("__iter__", 0, "() -> an iterator of (ids, labels) micro-batches"),
        method("state_dict", 0, "() -> its position, saved in checkpoints"),
        method("load_state_dict", 1, "(state) restore a position state_dict() returned"),
        value("may_end", (bool,), "the loader can run out (DataExhausted) before the run's last step; default False", False, default=False),
        value("per_rank_state", (bool,), "its state_dict differs per rank and is saved per rank; default False", False, default=False),
    ],
    "model_module": [
        method("step_metrics", 1, "(reduce) -> {name: value}: its own metrics on log steps, reduced over ranks by the core's reduce; default: none", False),
        method("extra_metrics", 0, "() -> {name: value}: this rank's view, on log steps; default: none", False),
        method(
            "log_step",
            1,
            "(on) the coming training step is (True) or is not a log step: what only log steps report may be measured on those alone; default: none",
            False,
        ),
    ],
}

_DECLARED: dict[tuple[str, str], Member] = {(slot, m.name): m for table in (CONTRACT, MADE) for slot, members in table.items() for m in members}


def provides(obj: Any, name: str) -> bool:
    """Whether ``obj`` has member ``name`` set to something other than None."""
    return getattr(obj, name, None) is not None


def member(slot: str, obj: Any, name: str) -> Any:
    """Member ``name`` of ``obj`` as :data:`CONTRACT` (or :data:`MADE`) declares it for ``slot``: the
    member, or the declared default when ``obj`` lacks it or sets it to None (the one rule for
    optional members). The one way the core reads a member of a plugin's object; a name not
    declared for ``slot`` is a KeyError (the core reads nothing undeclared)."""
    declared = _DECLARED[(slot, name)]
    found = getattr(obj, name, None)
    return declared.default if found is None else found


def _positional(fn: Any) -> tuple[int, int] | None:
    """(required, maximum) positional parameters of a bound callable; None if unknown."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    ps = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values()):
        return sum(p.default is p.empty for p in ps), 10**6
    return sum(p.default is p.empty for p in ps), len(ps)


def check_component(slot: str, name: str, obj: Any) -> None:
    """Hold the object a factory returned to the slot's contract, or raise PluginError (one line)."""
    where = f"{slot} plugin {name!r}"
    for m in CONTRACT.get(slot, []):
        present = hasattr(obj, m.name) and (m.required or provides(obj, m.name))  # optional set to None: absent
        if not present:
            if m.required:
                raise PluginError(f"{where}: its factory returned {type(obj).__name__}, which lacks {m.name} ({m.describe()}; core/contract/members.py)")
            continue
        if m.needs and member(slot, obj, m.needs) is None:
            raise PluginError(f"{where}: {m.name} needs {m.needs} too ({next(n for n in CONTRACT[slot] if n.name == m.needs).doc}); core/contract/members.py")
        found = getattr(obj, m.name)
        if m.kind == "method":
            if not callable(found):
                raise PluginError(f"{where}: {m.name} must be a method taking {m.params} argument(s), got {type(found).__name__}")
            arity = _positional(found)
            if arity is not None and not arity[0] <= m.params <= arity[1]:
                raise PluginError(
                    f"{where}: {m.name} must take {m.params} argument(s) ({m.doc}); it takes {arity[0]}" + (f" to {arity[1]}" if arity[1] != arity[0] else "")
                )
        elif object not in m.types:
            a_bool_for_a_number = isinstance(found, bool) and bool not in m.types
            if not isinstance(found, m.types) or a_bool_for_a_number:
                raise PluginError(f"{where}: {m.name} must be {' | '.join(t.__name__ for t in m.types)} ({m.doc}), got {type(found).__name__} {found!r}")
    if slot == "model":
        _check_model_values(where, obj)
    if slot == "optimizer":
        from core.contract.param_groups import OptimizerOptions

        if not isinstance(obj.options, OptimizerOptions):
            raise PluginError(
                f"{where}: options must subclass core.contract.param_groups.OptimizerOptions (lr, weight_decay, "
                f"no_decay, lr_multipliers), got {type(obj.options).__name__}"
            )


def _check_model_values(where: str, spec: Any) -> None:
    """The model's cheap answers, asked once now rather than failing later."""
    if spec.vocab_size < 1:  # an int (checked above): no token id could be below it
        raise PluginError(f"{where}: vocab_size must be an int >= 1, got {spec.vocab_size!r}")
    counts = member("model", spec, "param_counts")
    if counts is not None:
        got = counts()
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(n, int) and n >= 0 for n in got)):
            raise PluginError(f"{where}: param_counts() must return (total, non_embedding) as two ints, got {got!r}")


def returned(value: Any, expected: type | tuple[type, ...], what: str, expected_text: str) -> Any:
    """``value`` when a plugin's method returned what the contract declares, else one line naming it."""
    if not isinstance(value, expected):
        raise PluginError(f"{what} returned {type(value).__name__}; expected {expected_text}")
    return value


def describe_contract() -> str:
    """The declaration as ``python -m core.plugins --contract`` prints it: each slot's members, then
    the members of the objects they make (the loader, the model module)."""
    lines = ["An optional member set to None is absent: the core then does without it (its default)."]
    for slot, members in [*CONTRACT.items(), *MADE.items()]:
        lines.append(f"[{slot}]" if slot in CONTRACT else f"[{slot}] (made by a component)")
        lines += [f"  {m.describe()}" for m in members]
    return "\n".join(lines)


def optional_provided(slot: str, obj: Any) -> list[str]:
    """The optional members of ``slot`` that ``obj`` provides (``python -m core.plugins`` lists them)."""
    return [m.name for m in CONTRACT.get(slot, []) if not m.required and provides(obj, m.name)]
