"""Everything the core reads from a plugin's object, and the check that holds a plugin to it.

:mod:`core.contract.protocols` states the required members of each slot. This table
lists those again with the **optional** ones: a plugin may leave an optional
member out, and the core then does without (the default column). A member
of one of these names that a plugin does define must have the declared
shape, because the core will use it: :func:`check_component` runs on every
component a config names, before any process group or model exists, and
refuses a missing required member or a malformed one with one line naming
the plugin, the member and what was expected. No name outside this table is
ever looked up on a plugin object. Two more belong to objects a plugin makes:
the loader (``may_end``, ``per_rank_state``: :class:`core.contract.protocols.DataLoaderLike`)
and the built model module (``step_metrics(reduce) -> dict``, optional: its own
metrics on log steps, reduced over ranks by the core's ``reduce``; or
``extra_metrics() -> dict``, optional, this rank's view;
:func:`core.contract.protocols.model_step_metrics`).

One rule for optional members, every reader held to it: set to None is absent (the core does
what the default column says), as if left out. ``python -m core.plugins --contract`` prints the table.
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

    def describe(self) -> str:
        what = f"method, {self.params} argument(s)" if self.kind == "method" else f"value ({' | '.join(t.__name__ for t in self.types)})"
        return f"{self.name}: {what}{'' if self.required else ', optional'}{f', needs {self.needs}' if self.needs else ''}: {self.doc}"


def method(name: str, params: int, doc: str, required: bool = True, needs: str = "") -> Member:
    return Member(name, "method", doc, required, params, needs=needs)


def value(name: str, types: tuple[type, ...], doc: str, required: bool = True) -> Member:
    return Member(name, "value", doc, required, types=types)


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
        method("param_counts", 0, "(total, non_embedding) parameter counts without building; default: counted on a meta build", False),
        value("max_seq_len", (int,), "longest sequence the model takes; longer data.seq_len is refused; default: unchecked", False),
        method("to_hf_state_dict", 1, "plait state dict -> Hugging Face names (core.export --format hf); default: no hf export", False, needs="hf_config"),
        method("from_hf_state_dict", 1, "Hugging Face state dict -> plait names (initial_load of an HF folder); default: HF folders are refused", False),
        method("hf_config", 0, "the Hugging Face config.json dict written by export; default: none (needed with to_hf_state_dict)", False),
        value(
            "architecture_options",
            (tuple,),
            "names of its [model] options that define the function its weights compute, not those a run may change on purpose "
            "(rope_theta, max_seq_len); a resume or initial_load of a checkpoint saved with other values is refused; default: shapes only",
            False,
        ),
        method("resolved_architecture", 0, "{name: value} as built, flavor resolved, resumes compare it; default: as written", False, "architecture_options"),
    ],
    "parallelism": [
        method("wrap", 4, "(model, spec, dist, precision) -> the module to call"),
        method("sync_context", 2, "(model, sync) -> context for one micro-step's backward"),
        method("clip_grad_norm", 2, "(model, max_norm) -> the global gradient norm tensor"),
        method("check_world", 1, "refuse a world size it cannot use (raise ConfigError); default: any", False),
        value("shards_parameters", (bool,), "parameters are sharded over ranks (plan's memory estimate); default False", False),
        value("wraps_before_compile", (bool,), "wrap before torch.compile instead of after (DDP); default False", False),
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
        method("parts", 0, "{label: source}: the sources it is made of (a mixture); the ones lacking a validation split are named; default: none", False),
        value(
            "samples_before_loader",
            (bool,),
            "an IndexedSource's sample() answers before loader() is called, so the first sample is checked at start (False: a stream inside); default True",
            False,
        ),
    ],
    "optimizer": [
        method("build", 1, "(param_groups) -> torch.optim.Optimizer"),
        value("options", (object,), "its options, an OptimizerOptions subclass (lr, weight_decay, no_decay, lr_multipliers)"),
        value("state_bytes_per_param", (int, float), "optimizer state bytes per parameter (plan, micro_batch auto); default 8", False),
        value(
            "separate_output_head",
            (bool,),
            "True: the untied output head gets its own group of kind 'output' (core.contract.protocols.output_head_params); default False: a matrix",
            False,
        ),
    ],
    "lr_schedule": [
        method("multiplier", 2, "(step, total_steps) -> multiplier of the peak learning rate"),
    ],
}


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
        present = hasattr(obj, m.name) and (m.required or getattr(obj, m.name) is not None)  # optional set to None: absent
        if not present:
            if m.required:
                raise PluginError(f"{where}: its factory returned {type(obj).__name__}, which lacks {m.name} ({m.describe()}; core/contract/members.py)")
            continue
        if m.needs and optional(obj, m.needs) is None:
            raise PluginError(f"{where}: {m.name} needs {m.needs} too ({next(n for n in CONTRACT[slot] if n.name == m.needs).doc}); core/contract/members.py")
        member = getattr(obj, m.name)
        if m.kind == "method":
            if not callable(member):
                raise PluginError(f"{where}: {m.name} must be a method taking {m.params} argument(s), got {type(member).__name__}")
            arity = _positional(member)
            if arity is not None and not arity[0] <= m.params <= arity[1]:
                raise PluginError(
                    f"{where}: {m.name} must take {m.params} argument(s) ({m.doc}); it takes {arity[0]}" + (f" to {arity[1]}" if arity[1] != arity[0] else "")
                )
        elif object not in m.types:
            a_bool_for_a_number = isinstance(member, bool) and bool not in m.types
            if not isinstance(member, m.types) or a_bool_for_a_number:
                raise PluginError(f"{where}: {m.name} must be {' | '.join(t.__name__ for t in m.types)} ({m.doc}), got {type(member).__name__} {member!r}")
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
    counts = optional(spec, "param_counts")  # declared in CONTRACT["model"]; None is absent
    if counts is not None:
        got = counts()
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(n, int) and n >= 0 for n in got)):
            raise PluginError(f"{where}: param_counts() must return (total, non_embedding) as two ints, got {got!r}")


def returned(value: Any, expected: type | tuple[type, ...], what: str, expected_text: str) -> Any:
    """``value`` when a plugin's method returned what the contract declares, else one line naming it."""
    if not isinstance(value, expected):
        raise PluginError(f"{what} returned {type(value).__name__}; expected {expected_text}")
    return value


def optional(obj: Any, name: str, default: Any = None) -> Any:
    """Optional member ``name`` of ``obj``, ``default`` when it lacks it or sets it to None."""
    member = getattr(obj, name, None)
    return default if member is None else member


def describe_contract() -> str:
    lines = ["An optional member set to None is absent: the core then does without it (its default)."]
    for slot, members in CONTRACT.items():
        lines.append(f"[{slot}]")
        lines += [f"  {m.describe()}" for m in members]
    return "\n".join(lines)


def optional_provided(slot: str, obj: Any) -> list[str]:
    """The optional members of ``slot`` that ``obj`` provides (``python -m core.plugins`` lists them)."""
    return [m.name for m in CONTRACT.get(slot, []) if not m.required and getattr(obj, m.name, None) is not None]
