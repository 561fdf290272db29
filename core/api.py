"""plait's public API for plugin authors: import from here, and from nowhere else in ``core``.

A plugin is a module named by an entry point in the group ``plait`` that implements
``plait_register(registry)`` with :data:`hookimpl`; ``docs/writing_plugins.md`` walks through
one component per slot (``examples/plait-example-plugin`` is the installable example).
These docstrings are the reference: ``help(core.api.<name>)`` answers what a plugin author asks.
What this module holds, by group:

* **Hooks**: :data:`hookimpl` marks ``plait_register`` and a monitor's run-event methods
  (:data:`RUN_EVENT_HOOKS`; each hook's arguments, return value and timing: ``help(core.api.hookspecs)``).
  ``plait_register`` receives a :class:`Registry`; ``plait_preflight`` a :class:`PreparedRun`, the
  other run-event hooks a :class:`Run`.
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
  in, :class:`TokenizerSpec` what a source's ``tokenizer()`` returns (:func:`declared_tokenizer` reads it, and :func:`data_end_of_document_id` a source's end-of-document id, for sources made of sources); :func:`high_precision_modules`, :func:`data_tokens_per_epoch`, :func:`data_fingerprint`,
  :func:`data_has_split` and :func:`data_parts` read a spec's or a source's optional member with
  the core's default (for plugins that wrap other plugins).
* **Base classes and data helpers**: :class:`IndexedSource` (a map-style data source: implement
  ``sample``) with :class:`IndexedLoader`; :class:`OptimizerOptions` for optimizers' options;
  :class:`DataExhausted` ends a loader; :func:`mix_seed`, :func:`permute` and
  :func:`checked_sample` give deterministic samples; :func:`ignore_stop_signals`,
  :func:`shut_down_at_exit` and :func:`worker_context` are for loaders with worker processes; :func:`replace_durable`
  replaces a small file atomically and fsyncs it (state a monitor must not lose to a crash).
  :func:`build_component` builds a component of any slot from a table of its options, checked as a
  slot section's are (for plugins made of plugins, such as a mixture's sources).
* **Tokenizers**: :class:`Tokenizer` turns text into ids (``bytes``, ``hf:PATH``, ``tiktoken:PATH``), as
  data preparation, ``text_stream`` and ``core.generate`` do; :func:`need` imports an optional library
  or says in one line what needs it. :data:`TOKENIZER_KINDS` are the kinds a :class:`TokenizerSpec` may have;
  :func:`read_tokenizer_file` reads one with the size limit a checkpoint's record gets, and
  :func:`tokenizer_fingerprint` is its sha256 as ``meta.json`` and ``state.json`` record it.
* **Metric rows**: :func:`strict_row` makes a row strict JSON (a NaN or infinity as null, named in
  its ``not_finite`` object) and :func:`restore_not_finite` puts those values back.
* **Command-line tools**: :class:`ArgumentParser` (no abbreviations, a mistake is one line and exit
  code 2) and :func:`exit_bad_input` (print a :class:`PlaitError` as plait's one line, exit 2).
* **Model helpers**: :func:`chunked_cross_entropy` and :func:`output_cross_entropy` (the loss
  without materializing all logits); a model module's ``step_metrics(reduce)`` receives
  ``reduce = lambda parts: reduce_parts(parts, dist)`` (:func:`reduce_parts` states its rules); a
  monitor's ``plait_metrics`` returns :class:`Reduced` values instead of a collective of its own;
  :func:`squared_norm_share` is a parameter's (or gradient's) share of its squared norm, summed over
  the ranks under ddp and fsdp2 alike.
* **Errors**: raise :class:`ConfigError`, :class:`DataError`, :class:`PluginError` or
  :class:`CheckpointError` (all :class:`PlaitError`) with one line naming the key or file: plait
  prints it and exits with code 2. :func:`closest` makes the ``(did you mean ...?)`` suffix.
* **Evaluation**: :mod:`evaluation <core.loop.evaluation>`: multiple-choice task files read and
  checked, batched log-likelihoods (:class:`~core.loop.evaluation.Scorer`), bits per byte; the
  ``downstream`` monitor, ``core.eval`` and the lm-evaluation-harness model share it.
* **Logging**: :mod:`log <core.contract.log>` (``log.info``, ``log.note``, ``log.warn(..., once=key)``,
  ``log.error``): rank 0 speaks unless ``all_ranks=True``, each line prefixed ``plait:``.
  Plugins do not ``print``.

Where the answers are:

* the fields of a :class:`Run`, the core's ``run.state`` keys and the signature of
  ``run.request_stop(reason, checkpoint=True, source="", exit_code=0)``: ``help(core.api.Run)``;
  what ``plait_preflight``'s ``prep`` holds: ``help(core.api.PreparedRun)``;
* that gradients at ``plait_before_update`` are already clipped (its ``clip_coef``):
  ``help(core.api.hookspecs.plait_before_update)``;
* how to declare a required option, and whether a list default is allowed (it is):
  ``help(core.api.option)``;
* whether ``multiplier(step, total_steps)`` is 0- or 1-based (0-based: the first update uses step
  0): ``help(core.api.LRSchedule)``;
* how parameters are sorted into kinds (a tied head stays ``embedding``; learned positions are
  ``embedding`` as an ``nn.Embedding``, ``matrix`` as a bare parameter), and whether a tied
  ``lm_head.weight`` reaches ``to_hf_state_dict`` (it does, under its own name), what
  ``param_counts()``'s non-embedding count leaves out, and that ``hf_config()`` decides the exported
  architecture: ``help(core.api.ModelSpec)``;
* the keys of a parameter group (``params``, ``name``, ``lr``, ``lr_mult``, ``weight_decay``):
  ``help(core.api.OptimizerOptions)``;
* what ``epoch_samples`` returns and what the loader does at an epoch's end (nothing: the source
  maps indices past one epoch): ``help(core.api.IndexedSource.epoch_samples)``;
* every member the core reads from each slot's object, with the default when an optional one is
  absent: :data:`CONTRACT` (``python -m core.plugins --contract``).

Everything here is a re-export: the import lines under ``TYPE_CHECKING`` below are the one list of
exports. The type checker reads them as imports; at run time :func:`__getattr__` imports each name
from the module its line names when first used, so importing this module imports neither torch nor
anything else (a command-line tool of a plugin, ``python -m plugins.data.prepare``, starts without
torch), and ``__all__`` is the names those lines import. An export is added with one import line.
"""

from __future__ import annotations

import ast as _ast
import importlib as _importlib
import typing as _typing
from pathlib import Path as _Path

if _typing.TYPE_CHECKING:  # the exports: one import line names each (read at run time by _exports)
    from core.config.registry import Registry
    from core.config.run_config import build_component
    from core.contract import hookspecs, log
    from core.contract.errors import ArgumentParser, CheckpointError, ConfigError, DataError, PlaitError, PluginError, closest, exit_bad_input
    from core.contract.hookspecs import RUN_EVENT_HOOKS, hookimpl
    from core.contract.json_rows import restore_not_finite, strict_row
    from core.contract.losses import chunked_cross_entropy, output_cross_entropy
    from core.contract.members import CONTRACT
    from core.contract.metrics import reduce_parts
    from core.contract.options import NoOptions, option
    from core.contract.param_groups import OptimizerOptions
    from core.contract.protocols import (
        SLOT_PROTOCOLS,
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
    from core.contract.run import PreparedRun, Run
    from core.data.indexed import DataExhausted, IndexedLoader, IndexedSource, checked_sample, ignore_stop_signals, mix_seed, permute, shut_down_at_exit
    from core.data.text_tokenizer import Tokenizer, need
    from core.data.tokenizer_spec import TOKENIZER_KINDS, TokenizerSpec, data_end_of_document_id, declared_tokenizer, read_tokenizer_file, tokenizer_fingerprint
    from core.data.worker_start import worker_context
    from core.loop import evaluation
    from core.runtime.durable_io import replace_durable
    from core.runtime.monitor_reductions import Reduced, squared_norm_share


def _exports() -> dict[str, str]:
    """name -> the module it is imported from, read from the import lines under TYPE_CHECKING above."""
    tree = _ast.parse(_Path(__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, _ast.If) and _ast.unparse(node.test) == "_typing.TYPE_CHECKING")
    return {alias.name: str(line.module) for line in block.body if isinstance(line, _ast.ImportFrom) for alias in line.names}


_MODULE_OF = _exports()
__all__ = list(_MODULE_OF)
__doc__ = f"{__doc__}\nThe exports, each with the module it comes from:\n\n" + "\n".join(f"* ``{name}``: ``{module}``" for name, module in _MODULE_OF.items())


def __getattr__(name: str) -> _typing.Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'core.api' has no attribute {name!r}")
    imported = _importlib.import_module(module)
    value = getattr(imported, name) if hasattr(imported, name) else _importlib.import_module(f"{module}.{name}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
