"""lm-evaluation-harness's own task definitions, read into plain requests that plait scores.

:func:`load` takes task names (lm-evaluation-harness's tasks, groups and tags, and those of
``include_path`` folders) and ``.yaml`` paths, loads them with lm-evaluation-harness's own
``TaskManager`` (its datasets, ``process_docs``, ``doc_to_text``, ``doc_to_choice``, ``doc_to_target``,
``target_delimiter``, ``description``, and few-shot contexts from its sampler, ``num_fewshot`` and the
sampler's seed set as ``lm_eval.simple_evaluate`` sets them) and builds its requests as
``simple_evaluate`` does on one process (``build_all_requests``, the first ``limit`` documents):

* ``multiple_choice``: per document, (context, choices, gold index, target_delimiter), each choice's
  request being ``context`` and ``target_delimiter + choice`` (:class:`ChoiceDoc`);
* ``loglikelihood_rolling``: per document, the text scored and the words and bytes the task's own
  ``process_results`` counts for ``word_perplexity`` and ``bits_per_byte`` (:class:`RollingDoc`);
* a group (``group:``, ``task:``): each of its tasks, and the group's ``aggregate_metric_list``
  (:class:`HarnessGroup`), aggregated as lm-evaluation-harness aggregates it.

What is loaded is kept for the process, by the arguments of :func:`load`: lm-evaluation-harness's task
index (``TaskManager``, seconds to tens of seconds over its own tasks) and the datasets are read once
however often the same tasks are asked for (the ``downstream`` monitor asks at preflight and at train start).

Datasets are read with the Hugging Face Hub offline: local files (``dataset_path: json`` / ``csv`` /
``parquet`` with ``dataset_kwargs: data_files:``, a local folder) or a copy already in the datasets
cache. lm-evaluation-harness is imported here only, when a task asks for it (the optional extra
``eval``). Bad input is a :class:`ConfigError` or :class:`DataError` naming the task and what was
expected: lm_eval missing, an unknown name, an output type plait does not score, data that is
not local, a document plait cannot score (a gold answer not among the choices, an empty choice). Several
gold answers (``doc_to_target`` a list of indices) are lm-evaluation-harness's ``multiple_target``: a
document is right when its argmax is any of them. ``multiple_input`` tasks (winogrande: a context per choice, one target) keep their
contexts per choice.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from core.contract.errors import ConfigError, DataError, closest

SCORED = ("multiple_choice", "loglikelihood_rolling")  # the output types plait scores
DEFAULT_FEWSHOT_SEED = 1234  # lm_eval.simple_evaluate's fewshot_random_seed
YAML_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class ChoiceDoc:
    doc_id: int
    context: str
    choices: tuple[str, ...]
    gold: int  # the first gold answer
    target_delimiter: str
    contexts: tuple[str, ...] = ()  # multiple_input: one context per choice, each followed by target
    target: str = ""
    golds: tuple[int, ...] = ()  # multiple_target: every gold answer (a list doc_to_target); else empty


@dataclass(frozen=True)
class RollingDoc:
    doc_id: int
    text: str
    words: int  # the task's word count (word_perplexity's weight)
    n_bytes: int  # the task's byte count (bits_per_byte's and byte_perplexity's weight)


@dataclass(frozen=True)
class HarnessTask:
    name: str  # lm-evaluation-harness's task name: eval/<name>/...
    source: str  # the name or .yaml path asked for
    output_type: str  # one of SCORED
    docs: list[Any]  # ChoiceDoc for multiple_choice, RollingDoc for loglikelihood_rolling


@dataclass(frozen=True)
class HarnessGroup:
    """An lm-evaluation-harness group with an ``aggregate_metric_list``: its metrics over its leaf tasks."""

    name: str
    source: str  # the name or .yaml path asked for
    tasks: tuple[str, ...]  # its leaf tasks' names (sub-groups' tasks included), as lm-evaluation-harness aggregates over them
    # (metric, weight_by_size, the leaf tasks whose metric_list reports it) of each aggregate_metric_list entry
    aggregates: tuple[tuple[str, bool, tuple[str, ...]], ...]


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """The Hugging Face Hub off while tasks load: local files and cached datasets only, no request that
    could hang or retry where no network exists."""
    import datasets.config
    import huggingface_hub.constants

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def _task_manager(names: list[str], include_path: list[Path], key: str) -> Any:
    """lm-evaluation-harness's TaskManager over ``include_path`` alone when it holds every name (quick),
    else over its own tasks too; an unknown name is a ConfigError naming ``key``."""
    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in include_path] or None
    if paths is not None:
        manager = TaskManager(include_path=paths, include_defaults=False)
        if all(n in manager.all_tasks for n in names):
            return manager
    if not names and paths is None:
        return TaskManager(include_defaults=False)
    manager = TaskManager(include_path=paths)
    for n in names:
        if n not in manager.all_tasks:
            raise ConfigError(
                f"{key}: unknown lm-evaluation-harness task {n!r}{closest(n, manager.all_tasks)}; expected a task, group or tag name "
                "(lm-eval ls tasks, or a task in an include_path folder), a .yaml task file or a .jsonl task file"
            )
    return manager


def _choice_docs(task: Any, name: str) -> list[ChoiceDoc]:
    """Each document's request, from the task's own instances (context with its few-shot examples)."""
    by_doc: dict[int, list[Any]] = {}
    for inst in task.instances:
        by_doc.setdefault(inst.doc_id, []).append(inst)
    delimiter = task.config.target_delimiter
    docs = []
    for doc_id, instances in sorted(by_doc.items()):
        doc = instances[0].doc
        where = f"lm-evaluation-harness task {name!r}, document {doc_id}"
        choices = [str(c) for c in task.doc_to_choice(doc)]
        args = [inst.args for inst in sorted(instances, key=lambda i: i.idx)][: len(choices)]  # acc_mutual_info adds unconditional ones after
        context = args[0][0]
        target = str(task.doc_to_target(doc)) if task.multiple_input else ""
        wanted = [(a[0], f"{delimiter}{target}") for a in args] if task.multiple_input else [(context, f"{delimiter}{c}") for c in choices]
        if [tuple(a) for a in args] != wanted or len(args) != len(choices):
            raise DataError(f"{where}: requests that are not (context, target_delimiter + choice) nor multiple_input's; plait scores those")
        if not all(choices):
            raise DataError(f"{where}: an empty choice; expected non-empty choices (acc_norm divides by their length)")
        gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
        if isinstance(gold, str):
            gold = choices.index(gold) if gold in choices else gold
        golds = gold if isinstance(gold, list) and task.multiple_target else [gold]
        if not golds or not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < len(choices) for g in golds):
            raise DataError(f"{where}: gold answer {gold!r}; expected an index into the {len(choices)} choices (or one of them), or a list of indices")
        contexts = tuple(a[0] for a in args) if task.multiple_input else ()
        docs.append(ChoiceDoc(doc_id, context, tuple(choices), golds[0], delimiter, contexts, target, tuple(golds) if task.multiple_target else ()))
    return docs


def _rolling_docs(task: Any) -> list[RollingDoc]:
    """Each document's text and the words and bytes its ``process_results`` weighs it by."""
    docs = []
    for inst in sorted(task.instances, key=lambda i: i.doc_id):
        (text,) = inst.args
        counts = task.process_results(inst.doc, [0.0])
        words = counts["word_perplexity"][1] if "word_perplexity" in counts else task.count_words(text)
        n_bytes = next((counts[k][1] for k in ("bits_per_byte", "byte_perplexity") if k in counts), task.count_bytes(text))
        docs.append(RollingDoc(inst.doc_id, text, int(words), int(n_bytes)))
    return docs


def _groups(groups: dict[str, Any], spec: str) -> list[HarnessGroup]:
    """The groups among ``groups`` that aggregate (an ``aggregate_metric_list``), each over its leaf tasks."""
    out = []
    for name, group in groups.items():
        leaves = group.get_all_tasks()
        aggregates = tuple(
            (a.metric, bool(a.weight_by_size), tuple(t.task_name for t in leaves if a.metric in t._metric_fn_list)) for a in group.aggregate_metric_list or ()
        )
        for a in group.aggregate_metric_list or ():
            if a.aggregation != "mean" or a.filter_list not in (None, ["none"]):
                raise ConfigError(
                    f"lm-evaluation-harness group {name!r} ({spec}): aggregate_metric_list entry {a.metric!r} "
                    f"(aggregation {a.aggregation!r}, filter_list {a.filter_list!r}); plait aggregates with aggregation: mean over the filter none"
                )
        if aggregates:
            out.append(HarnessGroup(name, spec, tuple(t.task_name for t in leaves), aggregates))
    return out


def load(
    specs: Sequence[str],
    *,
    include_path: Sequence[str | Path] = (),
    limit: int = 0,
    num_fewshot: int | None = None,
    fewshot_seed: int = DEFAULT_FEWSHOT_SEED,
    key: str = "tasks",
) -> list[HarnessTask | HarnessGroup]:
    """Every task of ``specs`` (names, groups and tags expanded, and ``.yaml`` paths) with its documents'
    requests (the first ``limit``, 0: all), then the groups that aggregate. ``num_fewshot``: None, the
    task's own (else 0); a number overrides it except where the task fixes 0 (``simple_evaluate``'s rule).
    Errors name ``key``. Loaded once per process for the same arguments (:func:`_load`)."""
    return list(_load(tuple(specs), tuple(str(Path(p).resolve()) for p in include_path), limit, num_fewshot, fewshot_seed, key))


@functools.lru_cache(maxsize=8)
def _load(
    specs: tuple[str, ...], include_path: tuple[str, ...], limit: int, num_fewshot: int | None, fewshot_seed: int, key: str
) -> tuple[HarnessTask | HarnessGroup, ...]:
    folders = [Path(p) for p in include_path]
    for folder in folders:
        if not folder.is_dir():
            raise ConfigError(f"{key}: include_path {folder} is not a folder; expected a folder of lm-evaluation-harness task .yaml files")
    for spec in specs:
        if spec.endswith(YAML_SUFFIXES) and not Path(spec).is_file():
            raise DataError(f"{key}: lm-evaluation-harness task file {spec} does not exist")
    try:
        import lm_eval.tasks  # noqa: F401 - the optional dependency, checked before anything is read
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"{key}: {specs[0]!r} is an lm-evaluation-harness task and needs {(e.name or 'lm_eval').split('.')[0]}, in the optional extra 'eval': "
            "pip install -e '.[eval]' (plait's own .jsonl task files need nothing)"
        ) from None
    for noisy in ("lm_eval", "datasets"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    manager = _task_manager([s for s in specs if not s.endswith(YAML_SUFFIXES)], folders, key)
    for spec in specs:  # a named task's output type, from its indexed config: before any data is read
        entry = manager.task_index.get(spec)
        output_type = (getattr(entry, "cfg", None) or {}).get("output_type")
        if output_type is not None and output_type not in SCORED:
            raise ConfigError(f"{key}: lm-evaluation-harness task {spec!r} has output_type {output_type!r}; plait scores {' and '.join(SCORED)}")
    out: list[HarnessTask | HarnessGroup] = []
    groups: list[HarnessGroup] = []
    for spec in specs:
        with hub_offline():
            try:
                loaded = manager.load([spec])
                tasks = loaded["tasks"]
            except (ConfigError, DataError):
                raise
            except Exception as e:  # noqa: BLE001 - lm-evaluation-harness's and datasets' own errors, named with the task
                why = " ".join(str(e).split())[:300]
                expected = (
                    "local data (plait never reaches the network): dataset_path: json (or csv, parquet) with dataset_kwargs: data_files: {split: FILE}, "
                    "or the dataset in the datasets cache"
                    if isinstance(e, (ConnectionError, FileNotFoundError))
                    else "data_files for every split the task names (training_split, validation_split, test_split, fewshot_split)"
                    if isinstance(e, KeyError)
                    else "a task lm-evaluation-harness itself can load"
                )
                raise DataError(f"{key}: lm-evaluation-harness task {spec!r} could not be loaded ({type(e).__name__}: {why}); expected {expected}") from None
        for name, task in tasks.items():
            output_type = task.get_config("output_type")
            if output_type not in SCORED:
                raise ConfigError(f"{key}: lm-evaluation-harness task {name!r} ({spec}) has output_type {output_type!r}; plait scores {' and '.join(SCORED)}")
            if num_fewshot is not None and task.get_config("num_fewshot") != 0:
                task.set_config(key="num_fewshot", value=num_fewshot)
            elif task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=fewshot_seed)
            try:
                task.build_all_requests(limit=limit or None, rank=0, world_size=1)
            except Exception as e:  # noqa: BLE001 - a template or a document the task's own code fails on
                why = " ".join(str(e).split())[:300]
                raise DataError(f"{key}: lm-evaluation-harness task {name!r} ({spec}): its requests could not be built ({type(e).__name__}: {why})") from None
            docs = _choice_docs(task, name) if output_type == "multiple_choice" else _rolling_docs(task)
            if not docs:
                raise DataError(f"{key}: lm-evaluation-harness task {name!r} ({spec}): no documents in its evaluation split")
            out.append(HarnessTask(name, spec, output_type, docs))
        groups += _groups(loaded["groups"], spec)
    return (*out, *groups)
