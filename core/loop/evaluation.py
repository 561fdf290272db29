"""Downstream evaluation: multiple-choice tasks by log-likelihood, and bits per byte on held-out text.

The one implementation that the in-loop ``downstream`` monitor (``plugins/monitors/downstream.py``),
``python -m core.eval`` and the lm-evaluation-harness model (``core/cli/lm_eval_model.py``) share.

* **Tasks** (:func:`read_tasks`): plait's task files (``.jsonl``), and lm-evaluation-harness task names
  and ``.yaml`` files of output type ``multiple_choice`` or ``loglikelihood_rolling``, read by
  lm-evaluation-harness's own task loading and prompt templates (:mod:`core.loop.harness_tasks`: its
  requests, few-shot contexts included, become :class:`Example` items and :class:`RollingTask` texts).
* **Task files** (:func:`read_task`): JSON lines, one example each:
  ``{"context": "...", "continuations": ["...", "..."], "gold": 0}`` and optionally
  ``"target_delimiter": " "`` (default ``""``), lm-evaluation-harness's ``multiple_choice`` request:
  choice ``c`` is scored as the text ``target_delimiter + c`` after ``context``. A bad line, a gold
  index out of range, an empty choice list, a line over 1 MiB (read in bounded pieces, as held-out text is: never
  whole): a :class:`DataError` naming ``file:line``.
* **Encoding** (:func:`encode_pair`), lm-evaluation-harness 0.4's ``LM.loglikelihood`` /
  ``_encode_pair`` for a causal model: trailing whitespace of the context moves to the start of the
  continuation; the context is encoded alone and the whole string ``context + continuation`` once, the
  continuation's tokens being the whole string's tokens past the context's count. An empty context
  is the EOS token (lm-evaluation-harness's prefix token), unless the continuation starts with it.
* **Scoring** (:class:`Scorer`): the summed log-probability of each continuation's tokens given its
  context, in batches of rows sorted by length; contexts of one example whose continuations are all a
  single token are scored in one row (the context computed once). Truncation (:func:`resolve_max_len`):
  a sequence longer than ``max_len + 1`` tokens keeps its last ones (the context is cut from the left),
  ``max_len`` being the one asked for, else the model's ``max_seq_len``, else 2048, in the loop and
  offline alike.
* **Metrics** (:func:`task_sums`, :func:`task_metrics`): ``acc`` (the most likely continuation is
  the gold one), ``acc_norm`` (likelihood divided by the choice's length in characters, the
  delimiter and moved whitespace not counted: lm-evaluation-harness's ``acc_norm``),
  ``acc_norm_tokens`` (plait's own: divided by the continuation's length in tokens) and ``gold_ll``
  (plait's own: the gold continuation's mean log-likelihood, nats); ``acc_stderr`` and ``acc_norm_stderr``
  (lm-evaluation-harness's ``mean_stderr``); per example, :func:`task_samples`.
* **Rolling tasks** (:func:`rolling_metrics`): each document's text scored in the rolling windows below,
  ``word_perplexity``, ``byte_perplexity`` and ``bits_per_byte`` weighted by the words and bytes the
  task counts, as lm-evaluation-harness reports them.
* **Bits per byte** (:func:`rolling_requests`, :func:`bits_per_byte`): a text's tokens after the EOS
  token in lm-evaluation-harness's rolling windows (``get_rolling_token_windows`` with a context of one
  token, made disjoint): every token predicted once, each window's input ``max_len`` tokens long (the
  last one takes as many earlier tokens as context as fit); total negative log-likelihood / ln 2 / the
  text's UTF-8 bytes, comparable across tokenizers.

Work split over ranks: rank r scores items r, r + world, ... (:func:`share`); every rank runs the
same number of forwards (:meth:`Scorer.forwards`, short shares padded with a one-token forward) so a
sharded model's collectives match. The caller sums the per-rank tensors. Nothing here draws random
numbers or changes the model: forwards run under ``torch.no_grad`` in eval mode, the mode restored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, ContextManager, Iterator, NamedTuple, Sequence

import torch

from core.contract.errors import ConfigError, DataError
from core.loop import harness_tasks

Request = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)
SUMS = ("examples", "acc", "acc_norm", "acc_norm_tokens", "gold_ll")  # task_sums' order
STDERR = ("acc", "acc_norm")  # metrics also given with lm-evaluation-harness's standard error, <metric>_stderr
DEFAULT_MAX_LEN = 2048  # lm-evaluation-harness's default max_length, for a model that declares no max_seq_len
MAX_LINE_BYTES = 1 << 20  # a task or held-out text line longer than this is refused, never read whole


@dataclass(frozen=True)
class Example:
    context: str
    continuations: tuple[str, ...]
    gold: int
    line: int  # 1-based line of its file
    target_delimiter: str = ""  # put between the context and each continuation; not counted by acc_norm
    # lm-evaluation-harness's multiple_input (winogrande): choice i is target_delimiter + target scored after
    # contexts[i]; continuations are then its choices, whose lengths acc_norm divides by, as lm-evaluation-harness does
    contexts: tuple[str, ...] = ()
    target: str = ""
    golds: tuple[int, ...] = ()  # lm-evaluation-harness's multiple_target: every gold index (gold the first); right when the argmax is any

    def requests(self) -> list[tuple[str, str]]:
        """(context, continuation) of each choice, the delimiter put before the continuation."""
        if self.contexts:
            return [(c, self.target_delimiter + self.target) for c in self.contexts]
        return [(self.context, self.target_delimiter + c) for c in self.continuations]


@dataclass(frozen=True)
class Task:
    name: str  # the file's stem, or lm-evaluation-harness's task name: eval/<name>/acc
    path: Path  # the task file, or the lm-evaluation-harness task name or .yaml asked for
    examples: list[Example]
    harness: bool = False  # read by lm-evaluation-harness: an Example's line is its doc_id + 1

    def where(self, ex: Example) -> str:
        """The example, for a message: ``file:line``, or the lm-evaluation-harness task and document."""
        return f"lm-evaluation-harness task {self.name!r}, document {ex.line - 1}" if self.harness else f"{self.path}:{ex.line}"


@dataclass(frozen=True)
class RollingTask:
    """An lm-evaluation-harness ``loglikelihood_rolling`` task: each text's log-likelihood in rolling windows."""

    name: str
    source: str  # the task name or .yaml asked for
    texts: list[str]
    words: int  # summed over the texts, as the task counts them
    n_bytes: int
    docs: tuple[tuple[int, int, int], ...] = ()  # (doc_id, words, bytes) of each text, for its sample record


@dataclass(frozen=True)
class TaskGroup:
    """An lm-evaluation-harness group's aggregates over its leaf tasks (:func:`group_metrics`)."""

    name: str
    source: str  # the group name or .yaml asked for
    tasks: tuple[str, ...]  # leaf task names
    aggregates: tuple[tuple[str, bool, tuple[str, ...]], ...]  # (metric, weight_by_size, the leaf tasks reporting it)


def _example(obj: Any, where: str, line: int) -> Example:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with context, continuations and gold, got {type(obj).__name__}")
    missing = [k for k in ("context", "continuations", "gold") if k not in obj]
    if missing:
        raise DataError(f"{where}: missing {', '.join(repr(k) for k in missing)}; expected context, continuations and gold")
    context, choices, gold = obj["context"], obj["continuations"], obj["gold"]
    if not isinstance(context, str):
        raise DataError(f"{where}: 'context' is {type(context).__name__}; expected a string")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise DataError(f"{where}: 'continuations' must be a non-empty list of non-empty strings")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise DataError(f"{where}: 'gold' is {gold!r}; expected an index into the {len(choices)} continuations (0 to {len(choices) - 1})")
    delimiter = obj.get("target_delimiter", "")
    if not isinstance(delimiter, str):
        raise DataError(f"{where}: 'target_delimiter' is {type(delimiter).__name__}; expected a string")
    return Example(context, tuple(choices), gold, line, delimiter)


def bounded_lines(f: BinaryIO, path: Path, expected: str) -> Iterator[tuple[int, bytes]]:
    """(1-based number, bytes) of each line of ``f``, none read with more than ``MAX_LINE_BYTES + 1`` bytes
    held: a longer line is a DataError naming ``path:line`` (a file of one multi-GB line is never read whole)."""
    number = 0
    while raw := f.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(raw) > MAX_LINE_BYTES:
            raise DataError(f"{path}:{number}: a line of over {MAX_LINE_BYTES} bytes; expected {expected}")
        yield number, raw


def read_task(path: Path, limit: int = 0) -> Task:
    """The examples of task file ``path`` (every line checked; the first ``limit`` kept, 0: all)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"task file {path} does not exist (or is not a file)")
    examples: list[Example] = []
    try:
        with path.open("rb") as f:
            for number, raw in bounded_lines(f, path, "one JSON example"):
                where = f"{path}:{number}"
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise DataError(f"{where}: not a JSON line ({type(e).__name__}: {e})") from None
                ex = _example(obj, where, number)
                if not limit or len(examples) < limit:
                    examples.append(ex)
    except OSError as e:
        raise DataError(f"task file {path}: unreadable ({e.strerror or e})") from None
    if not examples:
        raise DataError(f"task file {path}: no examples; expected one JSON object per line")
    return Task(path.stem, path, examples)


TASK_FILE_SUFFIXES = (".jsonl", ".json")  # plait's own task files; anything else is lm-evaluation-harness's


def read_tasks(
    specs: Sequence[str | Path],
    limit: int = 0,
    key: str = "tasks",
    *,
    include_path: Sequence[str | Path] = (),
    num_fewshot: int | None = None,
    fewshot_seed: int = harness_tasks.DEFAULT_FEWSHOT_SEED,
) -> list[Task | RollingTask | TaskGroup]:
    """Every task, each checked: a ``.jsonl``/``.json`` path is plait's task file (:func:`read_task`); any
        other spec is an lm-evaluation-harness task name or ``.yaml`` file (:func:`harness_tasks.load`, with
        ``include_path``, ``num_fewshot`` and ``fewshot_seed``; a group gives its tasks and, when it aggregates,
    a :class:`TaskGroup`). Two tasks of one name: a ConfigError naming ``key``."""
    files = [str(s) for s in specs if str(s).endswith(TASK_FILE_SUFFIXES)]
    named = [str(s) for s in specs if not str(s).endswith(TASK_FILE_SUFFIXES)]
    tasks: list[Task | RollingTask | TaskGroup] = [read_task(Path(p), limit) for p in files]
    if named:
        loaded = harness_tasks.load(named, include_path=include_path, limit=limit, num_fewshot=num_fewshot, fewshot_seed=fewshot_seed, key=key)
        tasks += [from_harness(t) for t in loaded]
    seen: dict[str, str] = {}
    for t in tasks:
        origin = str(t.path) if isinstance(t, Task) else t.source  # type: ignore[union-attr]
        if t.name in seen:
            raise ConfigError(f"{key}: task {t.name!r} named twice ({seen[t.name]} and {origin}); rename one")
        seen[t.name] = origin
    return tasks


def from_harness(task: harness_tasks.HarnessTask | harness_tasks.HarnessGroup) -> Task | RollingTask | TaskGroup:
    """An lm-evaluation-harness task's requests as a :class:`Task` (multiple choice) or :class:`RollingTask`;
    a group as a :class:`TaskGroup`."""
    if isinstance(task, harness_tasks.HarnessGroup):
        return TaskGroup(task.name, task.source, task.tasks, task.aggregates)
    if task.output_type == "loglikelihood_rolling":
        docs: list[harness_tasks.RollingDoc] = task.docs
        per_doc = tuple((d.doc_id, d.words, d.n_bytes) for d in docs)
        return RollingTask(task.name, task.source, [d.text for d in docs], sum(d.words for d in docs), sum(d.n_bytes for d in docs), per_doc)
    examples = [Example(d.context, d.choices, d.gold, d.doc_id + 1, d.target_delimiter, d.contexts, d.target, d.golds) for d in task.docs]
    return Task(task.name, Path(task.source), examples, harness=True)


def encode_pair(context: str, continuation: str, encode: Callable[[str], list[int]], eos_id: int) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness 0.4 encodes a request for a causal model
    (``LM.loglikelihood``, ``TemplateLM._encode_pair``): the context's trailing whitespace moved into the
    continuation, the whole string encoded once and split at the context's own token count. An empty
    context (or one of whitespace only: plait's reading, where lm-evaluation-harness would encode an
    empty string) is the EOS token, or the continuation's first token when that is EOS."""
    stripped = context.rstrip()
    continuation, context = context[len(stripped) :] + continuation, stripped
    if not context:
        cont = list(encode(continuation))
        return (cont[:1], cont[1:]) if cont and cont[0] == eos_id else ([eos_id], cont)
    ctx = list(encode(context))
    return ctx, list(encode(context + continuation))[len(ctx) :]


class Encoded(NamedTuple):
    """An example's ids: its context's and each choice's continuation's; ``contexts``: one per choice where
    they differ (lm-evaluation-harness's ``multiple_input``), else None."""

    ctx: list[int]
    conts: list[list[int]]
    contexts: list[list[int]] | None = None

    def requests(self) -> list[Request]:
        return list(zip(self.contexts, self.conts)) if self.contexts is not None else [(self.ctx, c) for c in self.conts]


def encode_task(task: Task, encode: Callable[[str], list[int]], eos_id: int, vocab_size: int) -> list[Encoded]:
    """Each example's :meth:`Example.requests` encoded by :func:`encode_pair`. A text the tokenizer
    cannot encode, a context or continuation of no tokens or an id at or above ``vocab_size``: DataError naming the line."""
    out = []
    for ex in task.examples:
        where = task.where(ex)
        try:
            pairs = [encode_pair(ctx, cont, encode, eos_id) for ctx, cont in ex.requests()]
        except Exception as e:  # noqa: BLE001 - a tokenizer's own error, named with the line
            raise DataError(f"{where}: the tokenizer cannot encode this example ({type(e).__name__}: {e})") from None
        ctx, conts = pairs[0][0], [cont for _, cont in pairs]
        if not all(c for c, _ in pairs) or not all(conts):
            raise DataError(f"{where}: the context or a continuation encodes to no tokens")
        if not ex.contexts and any(c != ctx for c, _ in pairs):  # a continuation starting with EOS after an empty context
            raise DataError(f"{where}: an empty context and a continuation that starts with the EOS token; give the context")
        top = max(max(max(c) for c, _ in pairs), *(max(c) for c in conts))
        if top >= vocab_size:
            raise DataError(f"{where}: token id {top} is at or above the model's vocabulary size {vocab_size}")
        out.append(Encoded(ctx, conts, [c for c, _ in pairs] if ex.contexts else None))
    return out


def share(n: int, rank: int, world: int) -> range:
    """The items rank ``rank`` of ``world`` scores: ``rank, rank + world, ...``."""
    return range(rank, n, world)


Row = tuple[list[int], list[tuple[int, int, list[int]]]]  # (input ids, [(request index, first predicted position, continuation ids)])


def score_rows(requests: Sequence[Request], max_len: int) -> list[Row]:
    """The rows a :class:`Scorer` runs for ``requests``: (input ids, [(request index, first predicted position,
    continuation ids)]). Requests with one context and one-token continuations share a row (the context once);
    a longer sequence than ``max_len + 1`` tokens keeps its last ones."""
    rows: list[Row] = []
    single: dict[tuple[int, ...], int] = {}  # context -> its row of one-token continuations
    for i, (ctx, cont) in enumerate(requests):
        ctx, cont = list(ctx), list(cont)
        if len(cont) == 1 and len(ctx) <= max_len:
            key = tuple(ctx)
            if key not in single:
                single[key] = len(rows)
                rows.append((ctx, []))
            rows[single[key]][1].append((i, len(ctx) - 1, cont))
            continue
        full = (ctx + cont)[-(max_len + 1) :]
        rows.append((full[:-1], [(i, len(full) - 1 - len(cont), cont)]))
    return rows


def in_batches(rows: list[Row], batch_size: int) -> list[list[Row]]:
    """``rows`` in forwards of at most ``batch_size``, longest first (little padding)."""
    order = sorted(range(len(rows)), key=lambda r: -len(rows[r][0]))
    return [[rows[r] for r in order[b : b + batch_size]] for b in range(0, len(order), batch_size)]


class Interrupted(Exception):
    """The scorer's ``stop()`` said a stop signal came: every rank leaves the pass before the same forward."""


class Scorer:
    """Batched log-likelihoods of continuations given contexts, on ``model`` (``forward(ids) -> logits``).
    ``stop`` (the in-loop monitor's ``run.stop_signalled``, a collective) is asked before every forward;
    True raises :class:`Interrupted`, on every rank at the same forward."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_len: int,
        device: torch.device | str = "cpu",
        batch_size: int = 16,
        autocast: Callable[[], ContextManager] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        self.model, self.max_len, self.device, self.batch_size = model, max_len, torch.device(device), max(1, batch_size)
        self.autocast = autocast or contextlib.nullcontext
        self.stop = stop

    def check_stop(self) -> None:
        if self.stop is not None and self.stop():
            raise Interrupted

    def _batches(self, requests: Sequence[Request]) -> list[list[Row]]:
        return in_batches(score_rows(requests, self.max_len), self.batch_size)

    def forwards(self, requests: Sequence[Request]) -> int:
        """How many forwards :meth:`loglikelihoods` runs for ``requests``."""
        return len(self._batches(requests))

    @torch.no_grad()
    def loglikelihoods(self, requests: Sequence[Request], forwards: int = 0) -> list[tuple[float, bool]]:
        """(summed log-probability, greedy: each token the most likely) of each request, in order;
        at least ``forwards`` forwards are run (the extra ones on one token: a sharded model's collectives match)."""
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        batches = self._batches(requests)
        model, was_training = self.model, self.model.training
        model.eval()
        try:
            for batch in batches:
                self.check_stop()
                width = max(len(ids) for ids, _ in batch)
                inputs = torch.zeros((len(batch), width), dtype=torch.long)
                for r, (ids, _) in enumerate(batch):
                    inputs[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                with self.autocast():
                    logits = model(inputs.to(self.device))
                for r, (_, wanted) in enumerate(batch):
                    for i, start, cont in wanted:
                        logp = torch.log_softmax(logits[r, start : start + len(cont)].float(), dim=-1)
                        target = torch.tensor(cont, dtype=torch.long, device=logp.device)
                        ll = float(logp.gather(-1, target[:, None]).sum())
                        greedy = bool((logp.argmax(-1) == target).all())
                        out[i] = (ll, greedy)
            for _ in range(forwards - len(batches)):
                self.check_stop()
                with self.autocast():
                    model(torch.zeros((1, 1), dtype=torch.long, device=self.device))
        finally:
            model.train(was_training)
        return out


def argmax(values: Sequence[float]) -> int:
    """The index of the largest value, the first on a tie (as numpy's argmax)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def example_requests(encoded: list[Encoded], items: Sequence[int]) -> list[Request]:
    return [r for e in items for r in encoded[e].requests()]


def example_scores(ex: Example, conts: Sequence[Sequence[int]], lls: Sequence[float]) -> tuple[bool, bool, bool]:
    """(acc, acc_norm, acc_norm_tokens) of one example from its continuations' log-likelihoods ``lls``."""
    chars = [ll / len(c) for ll, c in zip(lls, ex.continuations)]
    tokens = [ll / len(c) for ll, c in zip(lls, conts)]
    right = ex.golds or (ex.gold,)
    return argmax(lls) in right, argmax(chars) in right, argmax(tokens) in right


def per_example(task: Task, encoded: list[Encoded], items: Sequence[int], lls: Sequence[float]) -> Iterator[tuple[int, list[float]]]:
    """(example index, its continuations' log-likelihoods) of ``items``, from ``lls`` in :func:`example_requests` order."""
    k = 0
    for e in items:
        n = len(encoded[e][1])
        yield e, list(lls[k : k + n])
        k += n


def task_sums(task: Task, encoded: list[Encoded], items: Sequence[int], lls: Sequence[float]) -> torch.Tensor:
    """The sums :data:`SUMS` over examples ``items`` of ``task``, from their continuations' log-likelihoods
    in :func:`example_requests` order (float64, to be summed over the ranks)."""
    sums = torch.zeros(len(SUMS), dtype=torch.float64)
    for e, mine in per_example(task, encoded, items, lls):
        ex = task.examples[e]
        sums += torch.tensor([1.0, *example_scores(ex, encoded[e][1], mine), mine[ex.gold]], dtype=torch.float64)
    return sums


def task_samples(task: Task, encoded: list[Encoded], items: Sequence[int], lls: Sequence[float]) -> Iterator[dict[str, Any]]:
    """One record per example of ``items`` (``core.eval --log-samples``): its text, each choice's log-likelihood, acc and acc_norm."""
    for e, mine in per_example(task, encoded, items, lls):
        ex = task.examples[e]
        acc, acc_norm, _ = example_scores(ex, encoded[e][1], mine)
        yield {
            "task": task.name,
            "index": e,
            **({"doc_id": ex.line - 1} if task.harness else {"line": ex.line}),
            "context": ex.context,
            **({"contexts": list(ex.contexts), "target": ex.target} if ex.contexts else {}),
            "target_delimiter": ex.target_delimiter,
            "choices": list(ex.continuations),
            "loglikelihoods": mine,
            "gold": list(ex.golds) if ex.golds else ex.gold,
            "acc": float(acc),
            "acc_norm": float(acc_norm),
        }


def mean_stderr(p: float, n: float) -> float:
    """lm-evaluation-harness's ``mean_stderr`` (sample standard deviation / sqrt(n)) of ``n`` values of 0 or 1
    with mean ``p``: sqrt(p (1 - p) / (n - 1))."""
    return math.sqrt(max(p * (1.0 - p), 0.0) / (n - 1))


def task_metrics(name: str, sums: torch.Tensor | Sequence[float]) -> dict[str, float]:
    """``eval/<name>/acc``, ``acc_norm``, ``acc_norm_tokens``, ``gold_ll`` from summed :data:`SUMS`, and
    ``acc_stderr``, ``acc_norm_stderr`` (:func:`mean_stderr`) when there are two examples or more."""
    s = [float(v) for v in sums]
    n = max(s[0], 1.0)
    out = {f"eval/{name}/{key}": s[i] / n for i, key in enumerate(SUMS) if i}
    if s[0] >= 2:
        for key in STDERR:
            out[f"eval/{name}/{key}_stderr"] = mean_stderr(out[f"eval/{name}/{key}"], s[0])
    return out


def rolling_metrics(task: RollingTask, sums: torch.Tensor | Sequence[float]) -> dict[str, float]:
    """``eval/<name>/word_perplexity``, ``byte_perplexity`` and ``bits_per_byte`` from summed (negative
    log-likelihood, tokens): lm-evaluation-harness's ``weighted_perplexity`` and ``bits_per_byte``."""
    nll = float(sums[0])
    return {
        f"eval/{task.name}/word_perplexity": math.exp(nll / max(task.words, 1)),
        f"eval/{task.name}/byte_perplexity": math.exp(nll / max(task.n_bytes, 1)),
        f"eval/{task.name}/bits_per_byte": bits_per_byte(nll, task.n_bytes),
    }


def rolling_samples(task: RollingTask, owners: Sequence[int], lls: Sequence[float]) -> Iterator[dict[str, Any]]:
    """One record per document of ``task`` (``core.eval --log-samples``) from its windows' log-likelihoods
    ``lls`` (``owners``: each window's document): ``doc_id``, the document's summed ``loglikelihood``
    (nats), and the ``words`` and ``bytes`` it is weighed by, as lm-evaluation-harness's samples carry them
    (``word_perplexity: [loglikelihood, words]``, ``bits_per_byte: [loglikelihood, bytes]``)."""
    total = [0.0] * len(task.texts)
    for owner, ll in zip(owners, lls):
        total[owner] += ll
    docs = task.docs or tuple((i, 0, 0) for i in range(len(task.texts)))
    for (doc_id, words, n_bytes), ll in zip(docs, total):
        yield {"task": task.name, "doc_id": doc_id, "loglikelihood": ll, "words": words, "bytes": n_bytes}


def group_metrics(
    group: TaskGroup, sizes: Sequence[int], parts: Sequence[tuple[int, Callable[[Any], dict[str, float]]]], sums: torch.Tensor | Sequence[float]
) -> dict[str, float]:
    """``eval/<group>/<metric>`` for each of the group's aggregates, from its leaf tasks' sums laid end to end
    (``parts``: each leaf's sum count and finish; ``sizes``: its documents), as lm-evaluation-harness 0.4.13's
    ``Group.aggregate``: over the leaves that report the metric (their ``metric_list``), the mean weighted by their sizes
    (``weight_by_size``) or not; ``<metric>_stderr`` when each has one, ``pooled_sample_stderr`` (weighted)
    or ``unweighted_mean_stderr``."""
    leaf: list[dict[str, float]] = []
    k = 0
    for n, finish in parts:
        leaf.append(finish(sums[k : k + n]))
        k += n
    out: dict[str, float] = {}
    for metric, weight_by_size, reporting in group.aggregates:
        have = [(m, size, name) for m, size, name in zip(leaf, sizes, group.tasks) if name in reporting and f"eval/{name}/{metric}" in m]
        if not have:
            continue
        values = [m[f"eval/{name}/{metric}"] for m, _, name in have]
        docs = [size for _, size, _ in have]
        weights = docs if weight_by_size else [1] * len(docs)
        out[f"eval/{group.name}/{metric}"] = sum(v * w for v, w in zip(values, weights)) / sum(weights)
        stderrs = [m.get(f"eval/{name}/{metric}_stderr") for m, _, name in have]
        if all(e is not None for e in stderrs):
            errs = [float(e) for e in stderrs if e is not None]
            out[f"eval/{group.name}/{metric}_stderr"] = (
                math.sqrt(sum((s - 1) * e**2 * s for s, e in zip(docs, errs)) / (sum(docs) - len(docs)) / sum(docs))
                if weight_by_size
                else math.sqrt(sum(e**2 for e in errs)) / len(errs)
            )
    return out


def rolling_requests(ids: Sequence[int], prefix: int, max_len: int) -> list[Request]:
    """Every token of ``ids`` predicted once, in windows of at most ``max_len`` predictions, the first after
    ``prefix`` (the EOS token): lm-evaluation-harness's ``get_rolling_token_windows(ids, prefix, max_len,
    context_len=1)`` made disjoint (``make_disjoint_window``). Each window's input is ``max_len`` tokens
    (fewer only when the text is shorter): the last, partial window has the tokens before it as context."""
    ids = list(ids)
    if not ids:
        return []
    first = min(max_len, len(ids))
    out: list[Request] = [([prefix], ids[:first])]
    done = first
    while done < len(ids):
        end = min(len(ids), done + max_len)
        out.append((ids[max(0, end - max_len - 1) : done], ids[done:end]))
        done = end
    return out


def resolve_max_len(asked: int, max_seq_len: int | None, key: str) -> int:
    """The longest sequence scored, in the loop and offline alike: ``asked`` (``key``), else the model's
    ``max_seq_len``, else :data:`DEFAULT_MAX_LEN`; more than ``max_seq_len`` is a ConfigError naming ``key``."""
    if max_seq_len is not None and asked > max_seq_len:
        raise ConfigError(f"{key} {asked} exceeds the model's max_seq_len {max_seq_len}")
    return asked or max_seq_len or DEFAULT_MAX_LEN


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    return nll_nats / math.log(2) / max(n_bytes, 1)


def held_out_metrics(held: "HeldOut", sums: torch.Tensor | Sequence[float]) -> dict[str, float]:
    """``eval/<name>/bpb`` and ``eval/<name>/loss`` (nats per token) from summed (negative log-likelihood, tokens)."""
    nll, tokens = float(sums[0]), float(sums[1])
    return {f"eval/{held.name}/bpb": bits_per_byte(nll, held.n_bytes), f"eval/{held.name}/loss": nll / max(tokens, 1.0)}


def read_token_file(path: Path, max_tokens: int) -> list[int]:
    """The first ``max_tokens`` ids (0: all) of a token ``.bin`` file; its dtype from ``meta.json`` beside it (default uint16)."""
    import numpy as np

    meta = path.parent / "meta.json"
    dtype = "uint16"
    if meta.is_file():
        try:
            dtype = str(json.loads(meta.read_text()).get("dtype", "uint16"))
        except (OSError, ValueError, AttributeError) as e:
            raise DataError(f"{meta}: not readable JSON ({e})") from None
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"{meta}: dtype {dtype!r}; expected uint16 or uint32")
    size = np.dtype(dtype).itemsize
    if not path.is_file() or path.stat().st_size < size:
        raise DataError(f"held-out file {path} does not exist or holds no tokens")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return [int(t) for t in (tokens[:max_tokens] if max_tokens else tokens)]


@dataclass(frozen=True)
class HeldOut:
    """A named held-out file's tokens and the UTF-8 bytes they stand for."""

    name: str
    path: Path
    ids: list[int]
    n_bytes: int


def read_held_out(
    name: str, path: Path, encode: Callable[[str], list[int]], byte_length: Callable[[list[int]], int], vocab_size: int, max_tokens: int
) -> HeldOut:
    """A ``.bin`` of token ids (bytes counted by ``byte_length``) or a UTF-8 text file (encoded), cut to ``max_tokens`` (0: all)."""
    path = Path(path)
    if path.suffix == ".bin":
        ids = read_token_file(path, max_tokens)
        n_bytes = byte_length(ids)
    else:
        try:
            with path.open("rb") as f:
                text = "".join(raw.decode("utf-8") for _, raw in bounded_lines(f, path, f"lines of text (held-out file {name!r})"))
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"held-out file {path} ({name!r}): unreadable as UTF-8 text ({e})") from None
        ids = list(encode(text))
        if max_tokens and len(ids) > max_tokens:
            ids = ids[:max_tokens]
        n_bytes = byte_length(ids) if max_tokens and len(ids) == max_tokens else len(text.encode("utf-8"))
    if not ids:
        raise DataError(f"held-out file {path} ({name!r}): no tokens")
    if max(ids) >= vocab_size:
        raise DataError(f"held-out file {path} ({name!r}): token id {max(ids)} is at or above the model's vocabulary size {vocab_size}")
    return HeldOut(name, path, ids, n_bytes)


@dataclass(frozen=True)
class PassCost:
    """The work of one pass of an :class:`Evaluation` over all ranks (:meth:`Evaluation.pass_cost`), for ``core.plan``."""

    items: int  # task examples and held-out windows
    requests: int  # sequences scored: one per choice of each example, one per held-out window
    forwards: tuple[tuple[int, int], ...]  # (rows, padded width in tokens) of each forward on one process

    @property
    def tokens(self) -> int:
        """Tokens the forwards take in, padding included."""
        return sum(rows * width for rows, width in self.forwards)


@dataclass
class Evaluation:
    """Tasks, rolling tasks and held-out files, encoded once, scored by :meth:`run` on this rank's share."""

    tasks: list[Task]
    encoded: list[list[Encoded]]
    held_out: list[HeldOut]
    eos_id: int
    rolling: list[tuple[RollingTask, list[list[int]]]] = dataclasses.field(default_factory=list)  # each with its texts' ids
    groups: list[tuple[TaskGroup, tuple[int, ...]]] = dataclasses.field(default_factory=list)  # each with its leaf tasks' documents

    def _work(self, scorer: Scorer, rank: int, world: int) -> Iterator[tuple[str, Any, list[Request], list[Request]]]:
        for t, enc in zip(self.tasks, self.encoded):
            every = [example_requests(enc, share(len(enc), r, world)) for r in range(world)]
            yield "task", (t, enc, share(len(enc), rank, world)), every[rank], max(every, key=scorer.forwards)
        texts: list[tuple[Any, list[list[int]]]] = [*self.rolling, *((h, [h.ids]) for h in self.held_out)]
        for what, ids in texts:
            owned = [(d, w) for d, one in enumerate(ids) for w in rolling_requests(one, self.eos_id, scorer.max_len)]
            every = [[owned[w][1] for w in share(len(owned), r, world)] for r in range(world)]
            owners = [owned[w][0] for w in share(len(owned), rank, world)]
            kind = "rolling" if isinstance(what, RollingTask) else "held_out"
            yield kind, (what, owners), every[rank], max(every, key=scorer.forwards)

    def run(
        self, scorer: Scorer, rank: int = 0, world: int = 1, samples: list[dict[str, Any]] | None = None
    ) -> dict[str, tuple[torch.Tensor, Callable[[torch.Tensor], dict[str, float]]]]:
        """This rank's sums per task and held-out file with the function that turns their totals over
        the ranks into metrics: ``{name: (sums, finish)}``. Every rank runs the same number of forwards.
        ``samples``: extended with this rank's :func:`task_samples` and :func:`rolling_samples` (one process's:
        a document's windows may lie on several ranks). A group's sums are its leaf tasks' laid end to end."""
        out: dict[str, tuple[torch.Tensor, Callable[[torch.Tensor], dict[str, float]]]] = {}
        for kind, what, mine, largest in self._work(scorer, rank, world):
            lls = [ll for ll, _ in scorer.loglikelihoods(mine, forwards=scorer.forwards(largest))]
            if kind == "task":
                task, enc, items = what
                out[task.name] = (task_sums(task, enc, items, lls), functools.partial(task_metrics, task.name))
                if samples is not None:
                    samples.extend(task_samples(task, enc, items, lls))
            else:
                text, owners = what
                total = torch.tensor([-sum(lls), float(sum(len(c) for _, c in mine))], dtype=torch.float64)
                out[text.name] = (total, functools.partial(rolling_metrics if kind == "rolling" else held_out_metrics, text))
                if samples is not None and kind == "rolling":
                    samples.extend(rolling_samples(text, owners, lls))
        for group, sizes in self.groups:
            parts = [out[name] for name in group.tasks]
            counts = [(len(s), finish) for s, finish in parts]
            out[group.name] = (torch.cat([s for s, _ in parts]), functools.partial(group_metrics, group, sizes, counts))
        return out

    def pass_cost(self, max_len: int, batch_size: int) -> PassCost:
        """The forwards one pass runs on one process (the work the ranks share), batched as :class:`Scorer`
        batches them: each task, rolling task and held-out file on its own, rows by :func:`score_rows`, cut
        at ``max_len``."""
        groups = [example_requests(enc, range(len(enc))) for enc in self.encoded]
        texts = [ids for _, ids in self.rolling] + [[h.ids] for h in self.held_out]  # rolling tasks' documents, held-out files
        windows = [[w for one in ids for w in rolling_requests(one, self.eos_id, max_len)] for ids in texts]
        forwards = tuple(
            (len(batch), max(len(ids) for ids, _ in batch))
            for group in groups + windows
            for batch in in_batches(score_rows(group, max_len), max(1, batch_size))
        )
        items = sum(len(enc) for enc in self.encoded) + sum(len(w) for w in windows)
        return PassCost(items, sum(len(g) for g in groups + windows), forwards)


def encode_rolling(task: RollingTask, encode: Callable[[str], list[int]], vocab_size: int) -> list[list[int]]:
    """Each text's ids (an empty text none, scored as nothing); a failure or an id at or above ``vocab_size``: DataError naming the task."""
    out = []
    for i, text in enumerate(task.texts):
        try:
            ids = list(encode(text)) if text else []
        except Exception as e:  # noqa: BLE001 - a tokenizer's own error, named with the document
            raise DataError(f"lm-evaluation-harness task {task.name!r}, document {i}: the tokenizer cannot encode it ({type(e).__name__}: {e})") from None
        if ids and max(ids) >= vocab_size:
            raise DataError(
                f"lm-evaluation-harness task {task.name!r}, document {i}: token id {max(ids)} is at or above the model's vocabulary size {vocab_size}"
            )
        out.append(ids)
    return out


def prepare(
    tasks: Sequence[Task | RollingTask | TaskGroup],
    held_out: list[HeldOut],
    encode: Callable[[str], list[int]],
    eos_id: int,
    vocab_size: int,
) -> Evaluation:
    """Tasks encoded (:func:`encode_task`, :func:`encode_rolling`; a DataError names the line or document the
    tokenizer fails on) with the held-out files; a group sized by its leaf tasks' documents."""
    choice = [t for t in tasks if isinstance(t, Task)]
    rolling = [(t, encode_rolling(t, encode, vocab_size)) for t in tasks if isinstance(t, RollingTask)]
    size = {t.name: len(t.examples) if isinstance(t, Task) else len(t.texts) for t in tasks if not isinstance(t, TaskGroup)}
    groups = [(g, tuple(size[name] for name in g.tasks)) for g in tasks if isinstance(g, TaskGroup)]
    return Evaluation(choice, [encode_task(t, encode, eos_id, vocab_size) for t in choice], held_out, eos_id, rolling, groups)


def evaluate_locally(evaluation: Evaluation, scorer: Scorer, samples: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """Every metric of ``evaluation`` on one process (``core.eval``, benchmarks); ``samples``: extended with
    one :func:`task_samples` record per example."""
    metrics: dict[str, float] = {}
    for sums, finish in evaluation.run(scorer, samples=samples).values():
        metrics.update(finish(sums))
    return metrics
