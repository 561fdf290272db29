"""``downstream``: multiple-choice and rolling tasks and bits per byte on held-out files, evaluated during training.

Every ``every`` steps and at the final step (a log step: ``every`` is a multiple of ``train.log_every``),
the model as it trains scores each task's first ``limit`` examples and each held-out file
(``core.api.evaluation``, the code ``python -m core.eval`` runs), split over the ranks, batched, and
adds ``eval/<task>/acc``, ``acc_norm`` (per character), ``acc_norm_tokens``, ``gold_ll``, the standard
errors ``acc_stderr``, ``acc_norm_stderr`` (rolling tasks: ``word_perplexity``, ``byte_perplexity``,
``bits_per_byte``) and ``eval/<name>/bpb``, ``eval/<name>/loss`` and the pass's wall time ``eval/time_s`` (the slowest rank's) to that step's metrics, so every monitor logs them
(whatever the order of ``monitors.enabled``), and ``checkpoint.best_metric`` can rank checkpoints by them. Its sums are returned as
``Reduced`` values (the core reduces them); the forwards run under ``torch.no_grad`` in eval mode,
with the run's precision, and the RNG states are put back afterwards: training is bit-identical with
it on or off (``tests/e2e/test_evaluation.py``). A stop signal is looked for before every forward
(``run.stop_signalled``): the pass ends, is not recorded, and the run stops with a checkpoint of the
step. Tasks are lm-evaluation-harness task names (``harness_tasks``, ``include_path`` searched too) or
``.yaml`` files, read by lm-evaluation-harness's own task loading with ``num_fewshot``, or plait
``.jsonl`` task files (``tasks``); a group adds its aggregates (``eval/<group>/<metric>``). They are read
and encoded at preflight and again at train start, lm-evaluation-harness's tasks loaded once per process
(and by ``core.plan``, which also estimates what the passes cost from them): bad input is one line
naming the task (or ``file:line``), exit 2.
"""

from __future__ import annotations

import contextlib
import functools
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from core.api import ConfigError, DataError, Reduced, Tokenizer, evaluation, hookimpl, log, option


@dataclass
class DownstreamOptions:
    every: int = option(500, "steps between evaluations (a multiple of train.log_every); also at the final step", gt=0)
    tasks: list[str] = option([], "task files: lm-evaluation-harness task .yaml files, or plait .jsonl files (context, continuations, gold)", path=True)
    harness_tasks: list[str] = option([], "lm-evaluation-harness task, group or tag names (multiple_choice, loglikelihood_rolling), include_path searched too")
    include_path: list[str] = option([], "folders of lm-evaluation-harness task .yaml files, searched for harness_tasks", path=True)
    num_fewshot: int = option(-1, "few-shot examples per context of lm-evaluation-harness tasks; -1: the task's own, else 0", ge=-1)
    fewshot_seed: int = option(1234, "seed of lm-evaluation-harness's few-shot sampler (lm_eval's default)")
    limit: int = option(500, "examples (or documents) per task, the first ones; 0: all", ge=0)
    held_out: dict[str, str] = option({}, "name -> held-out text file or token .bin file, reported as eval/<name>/bpb", path=True)
    held_out_tokens: int = option(65536, "tokens read from each held-out .bin file; 0: all", ge=0)
    batch_size: int = option(16, "sequences per forward", gt=0)
    max_len: int = option(0, "longest sequence scored, in tokens (contexts cut from the left); 0: the model's max_seq_len, else 2048 (as core.eval)", ge=0)
    tokenizer: str = option("", "bytes | hf:PATH | tiktoken:PATH (PATH from the working directory); empty: the tokenizer the data source declares")

    def check(self) -> None:
        if not self.tasks and not self.harness_tasks and not self.held_out:
            raise ValueError("tasks, harness_tasks and held_out are all empty: nothing to evaluate")
        files = [t for t in self.tasks if not t.endswith((".jsonl", ".json", ".yaml", ".yml"))]
        if files:
            raise ValueError(f"tasks: {files[0]!r}: expected a .yaml or .jsonl task file; put lm-evaluation-harness task names in harness_tasks")


def byte_length(spec: str, ids: list[int], eos_id: int) -> int:
    """The UTF-8 bytes token ids stand for (the EOS token none)."""
    kind, _, path = spec.partition(":")
    if kind == "bytes":
        return sum(1 for i in ids if i < 256)
    if kind == "hf":
        from tokenizers import Tokenizer

        return len(Tokenizer.from_file(path).decode([i for i in ids if i != eos_id], skip_special_tokens=False).encode("utf-8"))
    raise DataError(f"tokenizer {spec}: bits per byte of a token .bin file needs a bytes or hf tokenizer; give the held-out text instead")


def metric_of(finish: Callable[[Any], dict[str, float]], key: str, sums: Any) -> float:
    """Metric ``key`` of the totals ``sums`` (a ``Reduced`` finish)."""
    return finish(sums)[key]


class Downstream:
    def __init__(self, options: DownstreamOptions) -> None:
        self.options = options
        self.evaluation: evaluation.Evaluation | None = None
        self.max_len = 0

    def _prepare(self, tokenizer: dict[str, Any] | None, vocab_size: int, max_seq_len: int | None) -> None:
        """Task and held-out files read, checked and encoded: a DataError names the file and line."""
        o = self.options
        spec, eos = (o.tokenizer, None) if o.tokenizer else ((tokenizer["spec"], tokenizer.get("eos_id")) if tokenizer else (None, None))
        if spec is None:
            raise ConfigError("monitors.downstream.tokenizer: the data source declares no tokenizer; set this key (bytes, hf:PATH or tiktoken:PATH)")
        tok = Tokenizer(spec, eos, "monitors.downstream.tokenizer")
        if tok.vocab_size > vocab_size:
            raise DataError(f"monitors.downstream.tokenizer {spec}: {tok.vocab_size} ids, more than the model's vocabulary {vocab_size}")
        self.max_len = evaluation.resolve_max_len(o.max_len, max_seq_len, "monitors.downstream.max_len")
        tasks = evaluation.read_tasks(
            [*o.tasks, *o.harness_tasks],
            o.limit,
            key="monitors.downstream.tasks" if not o.harness_tasks else "monitors.downstream",
            include_path=o.include_path,
            num_fewshot=None if o.num_fewshot < 0 else o.num_fewshot,
            fewshot_seed=o.fewshot_seed,
        )
        held = [
            evaluation.read_held_out(name, Path(p), tok.encode, lambda ids: byte_length(spec, ids, tok.eos_id), vocab_size, o.held_out_tokens)
            for name, p in o.held_out.items()
        ]
        names = [t.name for t in tasks]
        both = sorted(set(names) & set(o.held_out))
        if both:
            raise ConfigError(f"monitors.downstream: {both[0]!r} names both a task and a held_out file")
        self.evaluation = evaluation.prepare(tasks, held, tok.encode, tok.eos_id, vocab_size)

    @hookimpl
    def plait_preflight(self, prep: Any) -> None:
        log_every = int(prep.resolved["train"]["log_every"])
        if self.options.every % log_every:
            raise ConfigError(
                f"monitors.downstream.every = {self.options.every}: expected a multiple of train.log_every = {log_every} (evaluations run on log steps)"
            )
        self._prepare(prep.tokenizer, prep.spec.vocab_size, getattr(prep.spec, "max_seq_len", None))

    @hookimpl
    def plait_planned_evaluation(self) -> dict[str, Any]:
        """One pass's forwards for ``core.plan`` (its files as ``plait_preflight`` read them), or why they are unknown."""
        if self.evaluation is None:
            return {"every": self.options.every, "cost": None, "why": "the task or held-out files are not readable here (see the problems below)"}
        return {"every": self.options.every, "cost": self.evaluation.pass_cost(self.max_len, self.options.batch_size)}

    @hookimpl
    def plait_train_start(self, run: Any) -> None:
        self._prepare(run.tokenizer, run.spec.vocab_size, getattr(run.spec, "max_seq_len", None))

    @hookimpl
    def plait_metrics(self, run: Any, step: int) -> dict[str, Any] | None:
        if self.evaluation is None or not (step % self.options.every == 0 or step == run.total_steps):
            return None
        device = run.dist.device
        precision = run.precision
        autocast = (lambda: precision.autocast(device)) if precision is not None else contextlib.nullcontext
        scorer = evaluation.Scorer(run.model, self.max_len, device, self.options.batch_size, autocast, stop=run.stop_signalled)
        py_state = random.getstate()
        devices = [device] if device.type == "cuda" else []
        start = time.perf_counter()
        try:
            with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
                results = self.evaluation.run(scorer, run.dist.rank, run.dist.world_size)
        except evaluation.Interrupted:  # every rank at the same forward: the run stops at this step with a checkpoint
            log.info(f"step {step}: downstream evaluation interrupted by a signal; not recorded")
            return None
        finally:
            random.setstate(py_state)
        out: dict[str, Any] = {"eval/time_s": Reduced("max", time.perf_counter() - start)}  # the pass's wall time, the slowest rank's
        for name, (sums, finish) in results.items():
            for key in finish(sums):  # the metric names; each reduced from the summed tensor
                out[key] = Reduced("sum", sums, finish=functools.partial(metric_of, finish, key))
        if run.dist.is_main:
            log.info(f"step {step}: evaluated {len(results)} task(s) and held-out file(s)")
        return out
