"""The seven slots of a plait run, as typed protocols.

A plugin registers a *component* for a slot (see :mod:`core.contract.hookspecs`): a
name, an options dataclass and a factory ``factory(options) -> object``. The
object the factory returns must satisfy the protocol of its slot below. The
core talks to plugins only through these protocols.

The protocols below are the required members. ``core/contract/members.py`` lists
them together with every optional member the core may read (and what it
does without one; one set to None is absent, the same), and checks each component against that list before a
run starts; ``python -m core.plugins --contract`` prints it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from core.contract.errors import PluginError
from core.contract.members import member

if TYPE_CHECKING:  # pragma: no cover
    from core.contract.param_groups import OptimizerOptions

SLOTS: tuple[str, ...] = (
    "model",
    "parallelism",
    "precision",
    "data",
    "optimizer",
    "lr_schedule",
    "monitor",
)

SLOT_DOCS: dict[str, str] = {
    "model": "builds the network: architecture, flavors, init and FLOPs",
    "parallelism": "wraps the model for data parallel training (single, ddp, fsdp2)",
    "precision": "numeric format of the forward and backward pass (fp32, bf16, fp8...)",
    "data": "where training tokens come from, addressed by global sample index",
    "optimizer": "turns gradients into updates",
    "lr_schedule": "learning-rate multiplier as a function of the step",
    "monitor": "receives run events through pluggy hooks: logging, guards",
}


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job: ``rank`` (0-based, over every node), ``world_size`` (the
    job's processes), ``local_rank`` (on its node), ``device`` (this process's torch device) and
    ``backend`` (``nccl``, ``gloo``, or ``none`` without a process group) and ``tp`` (ranks of one
    tensor-parallel group, consecutive ranks: they read the same batches) and ``pp`` (pipeline stages,
    the mesh's outer dimension: rank = (stage x dp + dp_rank) x tp + tp_rank; the stages of one
    pipeline read the same batches). ``dp_rank`` and ``dp_size``: this rank's data-parallel group and
    their count, ``rank // tp % dp_size`` and ``world_size // (tp x pp)``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "none"
    tp: int = 1
    pp: int = 1

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp % self.dp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@runtime_checkable
class ModelSpec(Protocol):
    """A model family at one flavor (one set of shapes).

    ``build()`` constructs the module on the current default device; the core
    calls it under ``torch.device("meta")``, converts it (precision), gives it storage
    and calls ``init_weights`` (no_grad, same seed on every rank), then wraps it. The module's
    ``forward(input_ids, labels)`` returns the mean cross-entropy over the
    tokens (a 0-dim tensor); ``forward(input_ids)`` returns logits.

    Optional members (what the core does without each: ``core.contract.members.CONTRACT``):
    ``high_precision_modules(model)``, ``compile_loss(model)``, ``param_counts()``,
    ``max_seq_len``, the Hugging Face adapters ``to_hf_state_dict(sd)``,
    ``from_hf_state_dict(sd)`` and ``hf_config()``, ``use_end_of_document_id(eod_id)`` (the data's end-of-document id or
    None, told before ``build()``; a document mask refuses None), ``resolved_architecture()``, and ``architecture_options``: a tuple of the
    names of its ``[model]`` options that define the function its weights compute (``n_heads``,
    ``norm_eps``; not ``rope_theta`` or ``max_seq_len``, which a run may change on purpose). A
    resume, or ``initial_load`` of a plait checkpoint, whose saved values of them (or model name)
    differ is refused (exit 2); without it only shapes are checked. ``resolved_architecture()``
    returns ``{option: value}`` as the spec was built (a flavor's defaults filled in); each
    checkpoint records it, and a resume compares those values. Tensor parallelism (``[parallelism]
    tp > 1``) needs ``check_tensor_parallel(tp)`` (refuse a degree its shapes or options cannot split
    into, ConfigError, before any process group) and ``parallelize_tensor(model, tp_mesh)`` (shard its
    modules over the 1-D tensor-parallel DeviceMesh with ``parallelize_module``, before activation
    checkpointing and compile; the forward's loss then runs under the parallelism's ``sync_context``,
    which may be ``loss_parallel``); a model without them is refused under tp > 1. Pipeline parallelism
    (``pp > 1``) needs ``check_pipeline(n_stages)`` (refuse a stage count, ConfigError, before any
    process group) and ``pipeline_stages(model, stage_ids, n_stages)``: the modules of those stages
    (embedding on the first, final norm and head on the last, blocks split evenly), whose
    ``forward(h=None, *, tokens, labels, micro_batch)`` takes the previous stage's output (the first:
    nothing) and the micro-batch's tokens, labels and index in the step (a one-element tensor; the
    schedule's first step runs each stage once more, on placeholders, to infer shapes, as micro-batch 0
    before it: state a stage records is to be replaced then), and returns hidden states or, on the last stage, the mean
    loss; ``model`` is pruned to those modules with their names unchanged, so each rank's state dict
    holds only its stages' parameters. A model without them is refused under pp > 1. The optional
    ``block_passes(model)`` tells ``core.plan`` the block applications of one forward of ``model``, whole
    or pruned to a stage (a looped block counts once per loop; default: its blocks), for a stage's
    share of the activations.
    The optional ``tensor_parallel_costs(tp, micro_batch, seq_len, bytes_per_element)`` tells
    ``core.plan`` the parameters every tp rank holds whole, one rank's activations and its tp
    communication.
    Expert parallelism (``[parallelism] ep > 1``) needs ``check_expert_parallel(ep)`` and
    ``parallelize_experts(model, ep_mesh)`` (keep each rank's share of the experts, as DTensors sharded
    over the expert-parallel mesh's first dimension, ``ep``, and replicated over its second, ``tp``, when
    tp > 1; exchange routed rows with ``all_to_all_single`` over ``ep``, and return the
    expert modules: the parallelism FSDP-shards each over the ranks holding the same experts and
    syncs their gradients there); a model without them is refused under ep > 1. The optional
    ``expert_parallel_costs(ep, micro_batch, seq_len, bytes_per_element)`` tells ``core.plan`` the
    experts' parameters (split by ep, each part FSDP-sharded over the replicas) and one rank's
    all-to-all bytes.

    **Parameter counts.** ``param_counts()`` returns ``(total, non_embedding)``, two ints, for
    ``core.plan`` to print (nothing else reads them). ``total`` counts a tied weight once;
    ``non_embedding`` leaves out the token embedding, learned positions made as an ``nn.Embedding``
    and the output head, tied or not (Kaplan et al. 2020's convention), and counts every other
    parameter, learned positions held as a bare ``nn.Parameter`` included. Without the member, the
    core counts a meta build by that rule: the parameters of every ``nn.Embedding`` and of every
    linear outside ``blocks(model)`` that maps to the vocabulary are not non-embedding.

    **Hugging Face export.** ``core.export --format hf`` writes ``config.json`` from ``hf_config()``
    alone, adding only ``torch_dtype`` and the tokenizer's ``bos_token_id``/``eos_token_id``: its ``architectures`` and
    ``model_type`` decide which transformers class loads the weights, so the names
    ``to_hf_state_dict(sd)`` returns must be that class's.

    **Tied weights.** Tie inside ``build()`` (``self.lm_head.weight = self.wte.weight``): the core
    records shared parameters before giving the module storage and shares them again after, so a
    tied weight is trained, counted, saved and loaded once. ``to_hf_state_dict(sd)`` receives the
    module's ``state_dict()`` with plait's names, in which a tied head *does* appear under its own
    name (``lm_head.weight``, the same tensor as the embedding's): drop it there when the Hugging
    Face config ties the embeddings, keep it otherwise. ``from_hf_state_dict(sd)`` must return every
    name of the module's ``state_dict()``, a tied head included (give it the embedding's tensor):
    missing or extra names are refused in one line.

    **Parameter kinds** (what the optimizer's ``no_decay`` and ``lr_multipliers`` name): a parameter
    owned by an ``nn.Embedding`` is ``embedding``, and stays ``embedding`` when a tied head shares
    it; one owned by a module whose class name ends in ``Norm`` is ``norm``; one named ``*bias`` is
    ``bias``; everything else is ``matrix``. So learned positions made as an ``nn.Embedding`` are
    ``embedding`` (no weight decay by default), while a bare ``nn.Parameter`` of positions on another
    module is ``matrix`` (decayed). Parameters with ``requires_grad = False`` are not trained.

    **µP** (:mod:`core.contract.mup`, docs/mup.md). ``[model] parametrization = "mup"`` asks for it; the
    spec declares its widths with ``mup_widths()``: ``(width, base_width)``, two ints, base_width a
    divisor of width, or None under standard parametrization. The core then multiplies each kind's
    LR (``matrix``: ``(base_width / width) ** p``, ``p`` the optimizer's ``mup_matrix_lr_power``;
    the others 1, the untied head in a group of its own); the model applies the rest itself: its
    output logits times ``base_width / width``, attention scores 1/d, an untied head's init std
    constant in width, hidden matrices at variance 1/fan_in. A model without ``mup_widths()`` (or
    one returning None) asked for µP is refused in one line, exit 2.
    """

    vocab_size: int

    def build(self) -> nn.Module: ...

    def init_weights(self, model: nn.Module) -> None: ...

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated transformer blocks: units of sharding, checkpointing and compile."""
        ...

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), convention in docs/metrics.md."""
        ...

    def activation_bytes(self, micro_batch: int, seq_len: int, bytes_per_element: int) -> int:
        """Estimated activation memory of one micro-batch kept for the backward pass."""
        ...


def spec_compile_loss(spec: ModelSpec, model: nn.Module) -> bool:
    """Call the model spec's optional ``compile_loss(model)`` (``train.compile``); False if it has none.
    The one place the core reads it."""
    compile_loss = member("model", spec, "compile_loss")
    if compile_loss is None:
        return False
    compile_loss(model)
    return True


@runtime_checkable
class Parallelism(Protocol):
    """Data parallel strategy. Applied after precision conversion.

    ``wrap`` gets the converted model, the same weights on every rank; ``sync_context`` and
    ``clip_grad_norm`` get what it returned. After a step's last backward every gradient must be
    the mean over ranks (each rank's loss is the mean over its own tokens), as DDP makes it.
    Optional members (defaults in ``core.contract.members.CONTRACT``): ``check_world(world_size)``,
    ``shards_parameters``, ``wraps_before_compile``, ``tensor_parallel`` (ranks of one
    tensor-parallel group, consecutive ranks reading the same batches; the data-parallel ranks are
    world size / it), ``expert_parallel`` (ranks of one expert-parallel group, taken from the
    data-parallel ranks) and ``shard_tensors(model, spec, dist)`` (the tensor- and expert-parallel
    sharding, applied before activation checkpointing and compile); ``pipeline_parallel`` (pipeline
    stages; the data-parallel ranks are world size / (tp x it)), ``pipeline_stages_per_rank``,
    ``check_micro_batches(n)`` and ``pipeline_step(model, micro_batches)`` (the step's micro-batches
    through a pipeline schedule: forward and backward, the step's mean loss returned on every rank),
    which replaces the micro-batch loop when ``pipeline_parallel > 1``.
    """

    def wrap(self, model: nn.Module, spec: ModelSpec, dist: DistInfo, precision: "Precision") -> nn.Module: ...

    def sync_context(self, model: nn.Module, sync: bool) -> ContextManager:
        """Context around one micro-step's forward and backward; ``sync=False`` skips the gradient sync."""
        ...

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip gradients (max_norm <= 0: no clipping) and return the global grad norm before clipping
        (as ``torch.nn.utils.clip_grad_norm_``: gradients scaled by ``min(1, max_norm / (norm + 1e-6))``)."""
        ...


@runtime_checkable
class Precision(Protocol):
    """Numeric format. ``supported`` is asked before anything is built.

    Optional members (defaults in ``core.contract.members.CONTRACT``): ``check_model(model)``,
    ``post_optimizer_step(model)``, ``log_step(on)`` and ``check_tensor_parallel(tp)`` (refuse a
    ``tp > 1`` its converted modules cannot run under, ConfigError, before any process group).
    """

    name: str

    def supported(self, device: torch.device) -> tuple[bool, str]:
        """(True, "") or (False, reason) for this device and installed libraries."""
        ...

    def convert(self, model: nn.Module, spec: ModelSpec) -> nn.Module:
        """Swap modules (e.g. fp8 linears) on the unwrapped, unsharded model, still on the meta
        device: its parameters have no values yet (storage and ``init_weights`` come after)."""
        ...

    def autocast(self, device: torch.device) -> ContextManager:
        """Context around each forward pass."""
        ...

    @property
    def param_dtype(self) -> torch.dtype | None:
        """Dtype sharded parallelisms should compute in (None: keep fp32)."""
        ...

    def metrics(self, model: nn.Module) -> dict[str, float]:
        """Health metrics (fp8 scales, amax) of the unwrapped model for a log step; may be empty."""
        ...


@dataclass
class LoaderSpec:
    """What the core asks of a data source: this rank's share of each step.

    ``seq_len`` tokens per sample's inputs; ``micro_batch`` samples per micro-batch on this rank;
    ``grad_accum`` micro-batches per optimizer step; ``dp_rank`` and ``dp_size``: this rank and the
    number of ranks; ``seed``: ``train.seed``; ``split``: ``train`` or ``val``; ``total_samples``:
    global samples the whole run will draw (0: unknown), for staged sources; ``vocab_size``: the
    model's vocabulary (set by the core; :class:`~core.data.indexed.IndexedLoader` refuses ids at or
    above it).
    """

    seq_len: int
    micro_batch: int
    grad_accum: int
    dp_rank: int
    dp_size: int
    seed: int
    split: str = "train"
    total_samples: int = 0
    vocab_size: int | None = None

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.micro_batch * self.grad_accum * self.dp_size


class DataLoaderLike(Protocol):
    """An iterator of micro-batches ``(inputs, labels)`` of shape [micro_batch, seq_len].

    ``iter()`` may be called again (after ``load_state_dict``, a rollback, a sequence-length stage):
    each new iterator goes on from the loader's position. ``state_dict()`` is that position after the
    micro-batches handed out so far (on CUDA read by a thread one step ahead); rank 0's is saved and
    loaded on every rank, also by a loader made for another ``seq_len``, ``micro_batch`` (a stage) or
    world size. Its optional ``consumed_samples`` (an int: global samples drawn, as
    :class:`core.data.indexed.IndexedLoader` keeps it) is what a resume reports and the source's
    ``metrics`` receive. A validation loader (``spec.split`` is ``validation.split``) is made for each
    pass and read for ``validation.batches`` micro-batches; one that ends sooner is averaged over those.
    It may end (``StopIteration``, or :class:`core.data.indexed.DataExhausted`). If it can end at a
    different step on different ranks it sets ``may_end = True``: the trainer then agrees across
    ranks before each step's compute (keeping each step's ``state_dict()``, which must be a cheap
    snapshot that reading on leaves as it is), and every rank stops together with a checkpoint.
    ``per_rank_state = True`` saves ``state_dict()`` per rank (streams) instead of rank 0's, which
    resumes only at the same world size (else exit 2 before training, ``core.plan`` too).
    """

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def loader_may_end(loader: DataLoaderLike) -> bool:
    """The loader's optional ``may_end`` flag (default False); the one place the core reads it."""
    return bool(member("loader", loader, "may_end"))


def loader_state_per_rank(loader: DataLoaderLike) -> bool:
    """The loader's optional ``per_rank_state`` flag (default False); the one place the core reads it."""
    return bool(member("loader", loader, "per_rank_state"))


def loader_consumed_samples(state: dict[str, Any]) -> int | None:
    """A loader state's optional ``consumed_samples`` (an int), else None; the one place the core reads it."""
    n = state.get("consumed_samples") if isinstance(state, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def model_step_metrics(model: nn.Module):
    """The built model module's optional ``step_metrics(reduce) -> dict``, or None; the one place the
    core reads it. ``reduce({name: (op, tensor)}) -> {name: tensor}`` reduces over the ranks
    (op ``mean``, ``sum``, ``max`` or ``min``) in one collective (:func:`core.contract.metrics.reduce_parts`)."""
    fn = member("model_module", model, "step_metrics")
    return fn if callable(fn) else None


def model_extra_metrics(model: nn.Module):
    """The built model module's optional ``extra_metrics() -> dict`` (this rank's view), or None."""
    fn = member("model_module", model, "extra_metrics")
    return fn if callable(fn) else None


def high_precision_modules(spec: Any, model: nn.Module) -> list[str]:
    """The model spec's optional ``high_precision_modules(model) -> list[str]``: names of modules
    (their children included) that precision plugins leave in high precision. Default: every
    linear that maps to the vocabulary (``out_features == vocab_size``), i.e. the output head,
    whatever the model calls it. The one place the core reads it."""
    fn = member("model", spec, "high_precision_modules")
    if fn is not None:
        return list(fn(model))
    vocab = member("model", spec, "vocab_size")
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m.out_features == vocab]


def output_head_params(spec: Any, model: nn.Module) -> tuple[nn.Parameter, ...]:
    """The output head's parameters: those of every linear that maps to the vocabulary
    (``out_features == vocab_size``) outside the spec's ``blocks(model)``, whatever the model calls it.
    A head tied to the embedding is among them (:func:`core.contract.param_groups.classify` keeps it an embedding)."""
    inside = {id(m) for block in spec.blocks(model) for m in block.modules()}
    vocab = spec.vocab_size
    return tuple(
        p for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == vocab and id(m) not in inside for p in m.parameters(recurse=False)
    )


def data_has_split(data: Any, split: str, who: str = "") -> bool:
    """The data source's optional ``has_split(split)`` (default True), held to its declared bool;
    ``who`` names the plugin in the error (default: the class)."""
    fn = member("data", data, "has_split")
    answer = True if fn is None else fn(split)
    if not isinstance(answer, bool):
        raise PluginError(f"{who or type(data).__name__}: has_split({split!r}) returned {answer!r}; expected True or False")
    return answer


def data_parts(data: Any, who: str = "") -> dict[str, Any]:
    """The data source's optional ``parts()``: ``{label: source}``, the sources it is made of (a
    mixture's); ``{}`` without it. The core names the parts that lack a validation split."""
    fn = member("data", data, "parts")
    parts = {} if fn is None else fn()
    if not isinstance(parts, dict) or not all(isinstance(k, str) for k in parts):
        raise PluginError(f"{who or type(data).__name__}: parts() returned {type(parts).__name__}; expected {{label: source}}")
    return parts


def data_samples_before_loader(data: Any) -> bool:
    """The data source's optional ``samples_before_loader`` flag (default True): an IndexedSource's
    ``sample()`` answers before ``loader()`` was called, so its first sample is checked at start."""
    return member("data", data, "samples_before_loader") is not False


def data_tokens_per_epoch(data: Any, who: str = "") -> int | None:
    """The data source's optional ``tokens_per_epoch()``: tokens in one pass over its training split,
    None (or absent) when it does not know (endless or streamed sources)."""
    fn = member("data", data, "tokens_per_epoch")
    size = None if fn is None else fn()
    if size is not None and (isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0):
        raise PluginError(f"{who or type(data).__name__}: tokens_per_epoch() returned {size!r}; expected an int >= 0 or None")
    return int(size) if size else None


def data_fingerprint(data: Any) -> str | None:
    """The data source's optional ``fingerprint()``: a short string that changes when its training
    data does (files, sizes, tokenizer); None (or absent) when it has none."""
    fn = member("data", data, "fingerprint")
    value = fn() if fn is not None else None
    return str(value) if value else None


def precision_log_step(precision: Any, on: bool) -> None:
    """Tell the precision plugin whether the coming step is a log step (its optional
    ``log_step(on)``: fp8 plugins then record forward and backward amax for ``metrics``)."""
    fn = member("precision", precision, "log_step")
    if fn is not None:
        fn(on)


def model_log_step(model: nn.Module, on: bool) -> None:
    """Tell the built model module whether the coming step is a log step (its optional ``log_step(on)``:
    ``recurrent_moe`` then runs its expert-collapse probe on that step's micro-batches only)."""
    fn = member("model_module", model, "log_step")
    if fn is not None:
        fn(on)


@runtime_checkable
class DataSource(Protocol):
    """A source of training tokens.

    Optional members (defaults in ``core.contract.members.CONTRACT``): ``has_split(split)``, ``check_resume(state, world_size)``,
    ``check_first_step(spec)``, ``metrics(consumed_samples)``, ``tokens_per_epoch()``, ``fingerprint()``, ``tokenizer()`` (a
    :class:`core.api.TokenizerSpec`, saved in checkpoints for ``core.export``), ``end_of_document_id()`` (the id ending each
    document of its samples, for a model's document mask), ``validation_loaders(spec)``, ``parts()`` and ``samples_before_loader``. Map-style sources subclass :class:`core.data.indexed.IndexedSource`.
    """

    def validate(self, vocab_size: int, seq_len: int) -> None:
        """Check files and token ids before any process group or model exists; raise DataError."""
        ...

    def loader(self, spec: LoaderSpec) -> DataLoaderLike: ...


def validation_parts(data: DataSource, spec: LoaderSpec) -> dict[str, DataLoaderLike]:
    """The data source's optional ``validation_loaders(spec)`` (declared in ``core/contract/members.py``):
    ``{label: loader}``, one loader of validation micro-batches per part of the source (a
    mixture's sources), evaluated as ``val_loss/<label>``; ``{}`` without it. The one place the
    core reads it. Every rank must get the same labels in the same order (each is a collective)."""
    parts = member("data", data, "validation_loaders")
    if parts is None:
        return {}
    loaders = parts(spec)
    if not isinstance(loaders, dict) or not all(isinstance(k, str) and k for k in loaders):
        raise PluginError(
            f"data plugin {type(data).__name__}: validation_loaders(spec) must return {{label: loader}} "
            f"with non-empty string labels, got {type(loaders).__name__}"
        )
    return loaders


@runtime_checkable
class OptimizerBuilder(Protocol):
    """Builds a torch optimizer from the parameter groups the core made.

    Optional members (defaults in ``core.contract.members.CONTRACT``): ``state_bytes_per_param``,
    ``separate_output_head``, ``mup_matrix_lr_power`` (under µP the matrix LR is multiplied by
    ``(base_width / width)`` to this power: 1, the default, for updates normalized entry by entry as
    Adam's, 0 for spectrally normalized ones as Muon's). A built optimizer whose ``step()`` honours ``found_inf`` (torch's
    ``_step_supports_amp_scaling``, as its fused kernels) skips a non-finite step on the device;
    any other is skipped from the host.
    """

    options: OptimizerOptions
    """Its options, an instance of a :class:`core.contract.param_groups.OptimizerOptions` subclass."""

    def build(self, param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        """One group per parameter kind (``params``, ``name``, ``lr`` = ``options.lr`` x the kind's
        ``lr_mult``, ``weight_decay``): pass them on as they are; the schedule scales each ``lr``."""
        ...


@runtime_checkable
class LRSchedule(Protocol):
    """The learning rate as a multiple of the peak LR, a pure function of the step.

    ``multiplier(step, total_steps)`` is 0-based: the first optimizer update of a run uses
    ``multiplier(0, total_steps)`` and the last ``multiplier(total_steps - 1, total_steps)``
    (``total_steps`` is the run's length, ``train.steps`` or what ``train.target_tokens`` gives).
    The core wraps it in ``torch.optim.lr_scheduler.LambdaLR``, so every parameter group's ``lr``
    (the peak times the kind's ``lr_mult``) is scaled by it; a skipped update still moves the
    schedule on. It must return a finite number >= 0 (checked before training, with a warning when
    it is still rising below 1 at the run's end: a warmup longer than the run). After a resume the step is the
    restored one, and the multiplier is asked again with this run's ``total_steps``.
    """

    def multiplier(self, step: int, total_steps: int) -> float: ...


class Monitor(Protocol):
    """A monitor is an object with pluggy ``hookimpl`` methods named after the run-event hooks
    (``core.api.RUN_EVENT_HOOKS``; each hook's reference: ``help(core.api.hookspecs)``).
    It may call ``run.request_stop(reason, checkpoint=True, source="", exit_code=0)``."""


# Which protocol each slot's object satisfies (the monitor slot's is hook methods, not members).
SLOT_PROTOCOLS: dict[str, type] = {
    "model": ModelSpec,
    "parallelism": Parallelism,
    "precision": Precision,
    "data": DataSource,
    "optimizer": OptimizerBuilder,
    "lr_schedule": LRSchedule,
    "monitor": Monitor,
}
