"""Validation every N steps on the data source's validation split.

Each evaluation reads the same ``batches`` micro-batches (the first global
samples of the split), so values are comparable across evaluations and
across world sizes. The loss is averaged over every rank's tokens. The best
value is kept in the train state (``best_val_loss``), which checkpoints save.

A data source made of parts (a mixture of sources) may offer each part's own
validation batches (``validation_loaders``, :func:`core.contract.protocols.validation_parts`):
each is evaluated the same way, on ``batches`` micro-batches of that part's
split, and reported as ``val_loss/<label>`` beside the overall ``val_loss``.
A validation loader that ends sooner (a small split) is averaged over the
batches every rank served, with a warning; one that serves none is an error.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from core.config.sections import ValidationOptions
from core.contract import log
from core.contract.errors import DataError
from core.contract.protocols import validation_parts
from core.data.indexed import DataExhausted
from core.runtime import watchdog
from core.runtime.distributed import mean_across_ranks


class ValidationLoss(float):
    """The overall validation loss (a plain float to every reader), carrying ``parts``:
    ``{"val_loss/<label>": loss}`` for each part of the data source (empty without parts).
    Monitors receive the parts through the trainer's ``plait_validation_end`` metrics."""

    parts: dict[str, float]

    def __new__(cls, value: float, parts: dict[str, float] | None = None) -> "ValidationLoss":
        obj = super().__new__(cls, value)
        obj.parts = dict(parts or {})
        return obj

    def __reduce__(self):  # pickles (and copies) as the plain float it stands for
        return float, (float(self),)


class Interrupted(Exception):
    """A stop signal reached a rank during validation: every rank leaves the pass at the same batch."""


def _mean_loss(trainer, loader, batches: int, what: str) -> float:
    model, device = trainer.train_model, trainer.dist.device
    it = iter(loader)
    total, served = torch.zeros((), device=device), 0
    for i in range(batches):
        watchdog.progress(f"in validation at step {trainer.run.step}, batch {i + 1} of {batches}")
        try:
            batch = next(it)
        except (StopIteration, DataExhausted):  # a small split: the pass averages what every rank served
            batch = None
        # A pre-emption's grace (30 s under torchrun, SLURM, Kubernetes) must not go to a long pass:
        # the ranks agree before each batch (a sharded forward has collectives) and leave together.
        signal, ended = trainer.control.agree([int(trainer.signals.received is not None), int(batch is None)], "max")
        if signal:
            raise Interrupted
        if ended:
            if not served:
                raise DataError(f"{what} served no micro-batch on some rank; validation needs at least one (validation.batches = {batches})")
            log.warn(f"{what} ended after {served} of validation.batches = {batches} micro-batches on some rank; the pass averages those", once=what)
            break
        inputs, labels = batch
        with trainer.c["precision"].autocast(device):
            total += model(inputs.to(device), labels.to(device)).float()
        served += 1
    return mean_across_ranks(total / served, trainer.dist).item()


@torch.no_grad()
def evaluate(trainer, opts: ValidationOptions) -> ValidationLoss:
    spec = trainer.loader_spec
    val_spec = dataclasses.replace(spec, grad_accum=1, split=opts.split, total_samples=0)
    data = trainer.c["data"]
    model = trainer.train_model
    was_training = model.training
    model.eval()
    try:
        what = f"data {trainer.rc.slots['data'].component.name!r}: the validation loader (split {opts.split!r})"
        loss = _mean_loss(trainer, data.loader(val_spec), opts.batches, what)
        parts = validation_parts(data, val_spec) if opts.per_source else {}
        per_part = {f"val_loss/{label}": _mean_loss(trainer, loader, opts.batches, f"{what}, part {label!r},") for label, loader in parts.items()}
    finally:
        model.train(was_training)
    return ValidationLoss(loss, per_part)


def validate(trainer, opts: ValidationOptions) -> None:
    """One validation pass at ``run.step``: monitors hear ``val_loss`` (and each part's), the best one
    is kept, and with ``checkpoint.keep_best`` a checkpoint entering the top is saved (:func:`consider_best`). A pass a stop
    signal interrupts records nothing; the step boundary right after it stops the run."""
    run = trainer.run
    try:
        loss = evaluate(trainer, opts)
    except Interrupted:
        log.info(f"step {run.step}: validation interrupted by a signal; not recorded")
        return
    best = min(run.state.get("best_val_loss", math.inf), loss)
    run.state["best_val_loss"] = best
    metrics = {"val_loss": loss, "best_val_loss": best, **loss.parts}
    trainer.monitors.emit("plait_validation_end", run=run, step=run.step, metrics=metrics)
    consider_best(trainer, metrics)


def consider_best(trainer, metrics: dict) -> None:
    """With ``checkpoint.keep_best``, a checkpoint whose ``checkpoint.best_metric`` (in ``metrics``: a
    validation's or a log step's) enters the top is saved. Rank 0's value is every rank's (a validation
    loss, a reduced monitor metric or the step's loss is the same on every rank anyway)."""
    opts, run = trainer.checkpointer.opts, trainer.run
    if not opts.keep_best or opts.best_metric not in metrics:
        return
    value = metrics[opts.best_metric]
    if opts.best_metric != "val_loss":  # a global mean already; any other metric: rank 0's
        value = trainer.control.agree(value, "root")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return
    key = float(value) if opts.best_mode == "min" else -float(value)
    ranking = run.state.setdefault("best_checkpoints", [])  # [[key, step], ...] best first (key: the value, negated for "max")
    if len(ranking) < opts.keep_best or key < ranking[-1][0]:
        ranking[:] = sorted(ranking + [[key, run.step]])[: opts.keep_best]
        trainer.checkpointer.save_best(run.step)
