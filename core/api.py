"""plait's public API for plugin authors: import from here, and from nowhere else in ``core``.

A plugin is a module named by an entry point in the group ``plait`` that implements
``plait_register(registry)`` with :data:`hookimpl`; ``docs/writing_plugins.md`` walks through
one component per slot (``examples/plait-example-plugin`` is the installable example).
What this module holds, by group:

* **Hooks**: :data:`hookimpl` marks ``plait_register`` and a monitor's run-event methods
  (:data:`RUN_EVENT_HOOKS`; their reference docs are in ``core/contract/hookspecs.py``). ``plait_register``
  receives a :class:`Registry`; run-event hooks receive a :class:`Run`.
* **Options**: every component has an options dataclass; each field is declared with
  :func:`option` (default, one-line doc, bounds). :class:`NoOptions` is for components without.
* **Slot protocols and run types**: the object a factory returns satisfies its slot's protocol
  (:data:`SLOTS`: :class:`ModelSpec`, :class:`Parallelism`, :class:`Precision`,
  :class:`DataSource`, :class:`DataLoaderLike`, :class:`OptimizerBuilder`, :class:`LRSchedule`,
  :class:`Monitor`; :data:`SLOT_PROTOCOLS` maps each slot to its protocol).
  The protocols declare the required members; :data:`CONTRACT` lists every member the core
  reads from each slot's object, the optional ones with what the core does without them, and
  every component is checked against it before a run starts (``python -m core.plugins
  --contract`` prints it). :class:`DistInfo` and :class:`LoaderSpec` are what the core hands
  in, :class:`TokenizerSpec` what a source's ``tokenizer()`` returns (:func:`declared_tokenizer` reads it, for sources made of sources); :func:`high_precision_modules`, :func:`data_tokens_per_epoch`, :func:`data_fingerprint`,
  :func:`data_has_split` and :func:`data_parts` read a spec's or a source's optional member with
  the core's default (for plugins that wrap other plugins).
* **Base classes and data helpers**: :class:`IndexedSource` (a map-style data source: implement
  ``sample``) with :class:`IndexedLoader`; :class:`OptimizerOptions` for optimizers' options;
  :class:`DataExhausted` ends a loader; :func:`mix_seed`, :func:`permute` and
  :func:`checked_sample` give deterministic samples; :func:`ignore_stop_signals`,
  :func:`shut_down_at_exit` and :func:`worker_context` are for loaders with worker processes; :func:`replace_durable`
  replaces a small file atomically and fsyncs it (state a monitor must not lose to a crash).
* **Model helpers**: :func:`chunked_cross_entropy` and :func:`output_cross_entropy` (the loss
  without materializing all logits); a model module's ``step_metrics(reduce)`` receives
  ``reduce = lambda parts: reduce_parts(parts, dist)`` (:func:`reduce_parts` states its rules); a
  monitor's ``plait_metrics`` returns :class:`Reduced` values instead of a collective of its own.
* **Errors**: raise :class:`ConfigError`, :class:`DataError`, :class:`PluginError` or
  :class:`CheckpointError` (all :class:`PlaitError`) with one line naming the key or file: plait
  prints it and exits with code 2. :func:`closest` makes the ``(did you mean ...?)`` suffix.
* **Evaluation**: :mod:`evaluation <core.loop.evaluation>`: multiple-choice task files read and
  checked, batched log-likelihoods (:class:`~core.loop.evaluation.Scorer`), bits per byte; the
  ``downstream`` monitor, ``core.eval`` and the lm-evaluation-harness model share it.
* **Logging**: :mod:`log <core.contract.log>` (``log.info``, ``log.note``, ``log.warn(..., once=key)``,
  ``log.error``): rank 0 speaks unless ``all_ranks=True``, each line prefixed ``plait:``.
  Plugins do not ``print``.

Everything here is a re-export; the definitions stay in their modules.
"""

from __future__ import annotations

from core.contract import log
from core.contract.errors import CheckpointError, ConfigError, DataError, PlaitError, PluginError, closest
from core.contract.hookspecs import RUN_EVENT_HOOKS, hookimpl
from core.contract.losses import chunked_cross_entropy, output_cross_entropy
from core.contract.members import CONTRACT
from core.contract.metrics import reduce_parts
from core.contract.options import NoOptions, option
from core.contract.param_groups import OptimizerOptions
from core.contract.protocols import (
    SLOTS,
    DataLoaderLike,
    DataSource,
    DistInfo,
    LoaderSpec,
    LRSchedule,
    ModelSpec,
    Monitor,
    OptimizerBuilder,
    Parallelism,
    Precision,
    data_fingerprint,
    data_has_split,
    data_parts,
    data_tokens_per_epoch,
    high_precision_modules,
)
from core.contract.registry import Registry
from core.contract.run import Run
from core.data.indexed import DataExhausted, IndexedLoader, IndexedSource, checked_sample, ignore_stop_signals, mix_seed, permute, shut_down_at_exit
from core.data.tokenizer_spec import TokenizerSpec, declared_tokenizer
from core.data.worker_start import worker_context
from core.loop import evaluation
from core.runtime.durable_io import replace_durable
from core.runtime.monitor_reductions import Reduced

__all__ = [
    # hooks
    "hookimpl",
    "RUN_EVENT_HOOKS",
    "Registry",
    "Run",
    # options
    "option",
    "NoOptions",
    # slot protocols and run types
    "SLOTS",
    "SLOT_PROTOCOLS",
    "CONTRACT",
    "ModelSpec",
    "Parallelism",
    "Precision",
    "DataSource",
    "DataLoaderLike",
    "OptimizerBuilder",
    "LRSchedule",
    "Monitor",
    "DistInfo",
    "LoaderSpec",
    "TokenizerSpec",
    "declared_tokenizer",
    "Reduced",
    "high_precision_modules",
    "data_fingerprint",
    "data_has_split",
    "data_parts",
    "data_tokens_per_epoch",
    # base classes and data helpers
    "IndexedSource",
    "IndexedLoader",
    "OptimizerOptions",
    "DataExhausted",
    "mix_seed",
    "permute",
    "checked_sample",
    "ignore_stop_signals",
    "shut_down_at_exit",
    "worker_context",
    "replace_durable",
    # model helpers
    "chunked_cross_entropy",
    "output_cross_entropy",
    "reduce_parts",
    # errors
    "PlaitError",
    "ConfigError",
    "PluginError",
    "DataError",
    "CheckpointError",
    "closest",
    # logging
    "log",
    # downstream evaluation (task files, batched log-likelihoods, bits per byte)
    "evaluation",
]

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
