"""The training loop: build, then fetch, step, count, log, validate, decide, save.

The pieces it drives each have one job: :mod:`core.loop.assemble` builds the state
(model, optimizer, schedule, loader, run counters), :class:`core.loop.step.TrainStep`
does one optimizer step, :mod:`core.loop.stop_policy` decides when to stop and save,
:class:`core.checkpoint.checkpointer.Checkpointer` saves the state it was built from,
:class:`core.loop.step_metrics.StepMetrics` measures a log window, and monitors hear
of it all through pluggy hooks (:mod:`core.loop.monitor_hub`).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path
from typing import Any

import torch

from core.checkpoint import EXIT_SAVE_FAILED, CheckpointDir, Checkpointer, NonFiniteState, SaveFailed
from core.contract import log
from core.contract import metrics as core_metrics
from core.contract.errors import EXIT_BAD_INPUT, PlaitError
from core.contract.members import member
from core.contract.protocols import DistInfo, data_fingerprint, loader_consumed_samples, model_log_step, precision_log_step
from core.data.prefetch import PrefetchingLoader, prefetching
from core.data.step_batches import StepBatches
from core.loop import stop_policy as policy
from core.loop.assemble import Assembled, assemble
from core.loop.monitor_hub import MonitorHub
from core.loop.nonfinite import EXIT_NONFINITE
from core.loop.step import TrainStep
from core.loop.step_metrics import StepMetrics
from core.loop.validation import consider_best, validate
from core.preflight import run_files
from core.preflight.prepare import Prepared
from core.runtime import distributed, watchdog
from core.runtime.stop_signals import StopSignals


class Trainer:
    built: Assembled  # set by build()
    monitors: MonitorHub  # set by build(), once the state is restored

    def __init__(self, prep: Prepared, dist: DistInfo) -> None:
        self.prep, self.dist, self.rc, self.c = prep, dist, prep.rc, prep.components
        self.output_dir = Path(self.rc.train.output_dir)
        self.signals = StopSignals()  # install() in the process that trains (core.cli.train)

    # the state, as monitors, tests and benchmarks read it
    model = property(lambda self: self.built.state.model)
    optimizer = property(lambda self: self.built.state.optimizer)
    scheduler = property(lambda self: self.built.state.scheduler)
    loader = property(lambda self: self.built.state.loader)
    run = property(lambda self: self.built.state.run)
    train_model = property(lambda self: self.built.train_model)
    guard = property(lambda self: self.stepper.guard)
    loader_spec = property(lambda self: self.built.loader_spec)

    # -- construction --------------------------------------------------------
    def build(self) -> None:
        """Everything the loop needs, resumed from the first candidate checkpoint that every
        rank finds sound and that loads (:meth:`core.checkpoint.Checkpointer.restore`); a load that fails half-way is
        followed by a fresh build of the state before the next candidate (or a fresh start)."""
        rc, dist = self.rc, self.dist
        if rc.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.control = distributed.ControlPlane(dist)
        self.check_precision_agrees()
        self.versions = run_files.library_versions()
        where = CheckpointDir(rc.sections["checkpoint"], self.prep.checkpoint_root, dist, self.control)
        candidates = list(self.prep.resume_candidates)
        model_meta = self.prep.model_meta  # built once by core.preflight.prepare (every rank: rank 0's candidates are everyone's)
        while True:
            path, candidates = where.first_sound(candidates, model_meta, self.prep.architecture)
            self.build_state(where, initial_load=path is None)
            if path is None or self.checkpointer.restore(path, last=not candidates):
                break
            self.close_loader()
            del self.built  # a half-done load must not leak into the next attempt
            gc.collect()
        if path is not None:
            self.checkpointer.leave_branch(path, self.prep.passed_over)
        else:
            self.checkpointer.set_aside_unusable()
        self.checkpointer.record_current_run()
        self.monitors = MonitorHub([(m.component.name, m.instantiate()) for m in rc.monitors], rc.monitors_options.on_error, self.c["model"].vocab_size)
        self.before_update_hooks, self.replace_batch_hooks = (self.monitors.implements(h) for h in ("plait_before_update", "plait_replace_batch"))

    def check_precision_agrees(self) -> None:
        if self.rc.precision_chain:  # every rank must have made the same choice
            names = [ch.component.name for ch in self.rc.precision_chain]
            mine = names.index(self.rc.slots["precision"].component.name)
            hi, neg_lo = self.control.agree([mine, -mine], "max")  # the largest and the smallest choice, in one collective
            if hi != -neg_lo:
                raise RuntimeError(f"ranks chose different precisions from {names}: devices differ between ranks")

    def build_state(self, where: CheckpointDir, initial_load: bool) -> None:
        """The fresh state (:func:`core.loop.assemble.assemble`), its checkpointer and its step."""
        rc = self.rc
        self.built = built = assemble(self.prep, self.dist, self.control, initial_load)
        built.state.run.stop_signalled = self.stop_signalled  # a monitor's long pass asks between its batches
        optimizer, fingerprint = rc.slots["optimizer"].component.name, data_fingerprint(self.c["data"])
        about = {"optimizer_plugin": optimizer, "versions": self.versions, "seed": rc.train.seed, "data_fingerprint": fingerprint, **self.prep.saved_facts}
        ckpt = self.checkpointer = Checkpointer(where, built.state, about, on_saved=self.on_checkpoint_saved)
        model_name = f"model {rc.slots['model'].component.name!r}"
        self.stepper = TrainStep(built.state, built.train_model, self.c, self.prep.grad_accum, rc.train.grad_clip, self.dist, ckpt.before_update, model_name)
        self.step_metrics = StepMetrics(self.dist)
        self.fetch = StepBatches(built.state, self.prep.grad_accum, self.control, self.dist, rc.slots["data"].component.name, self.step_metrics)
        self.last_skipped = 0  # steps skipped (non-finite) in the last log window
        self.skipping_now = 0  # steps skipped in a row up to the last read
        self.before_update_hooks = self.replace_batch_hooks = False  # set once the monitors exist

    def close_loader(self) -> None:
        """Stop the loader's read-ahead thread, if it has one (CUDA)."""
        if isinstance(self.built.state.loader, PrefetchingLoader):
            self.built.state.loader.close()

    # -- the loop ------------------------------------------------------------
    def fit(self) -> int:
        """Train to ``run.total_steps``: fetch, step, count, log, validate, decide, save."""
        run, ckpt, val = self.run, self.checkpointer, self.rc.sections["validation"]
        self.monitors.emit("plait_train_start", run=run)
        batches = iter(self.loader)
        reason, end_detail = policy.COMPLETED, ""
        if self.control.agree(int(run.stop is not None), "max"):  # a monitor failed to start: every rank stops
            run.request_stop("a monitor failed at train start", checkpoint=False, exit_code=4)
            run.total_steps = run.step
        last = time.perf_counter()
        while run.step < run.total_steps:
            if self.stage_changes():
                batches = self.switch_stage()
            is_log = run.is_log_step(run.step + 1)
            precision_log_step(self.c["precision"], is_log)  # fp8 plugins record amax on log steps only
            model_log_step(self.model, is_log)  # recurrent_moe probes its experts on log steps only
            watchdog.progress(f"reading the data of step {run.step + 1}", run.step)  # core.runtime.watchdog: what a stall names
            micro_batches, why = self.fetch.fetch(batches, self.built.loader_spec)  # core.data.step_batches
            if micro_batches is None:
                log.info(f"{why}; ending the run after step {run.step}")
                reason, end_detail = (policy.REQUESTED if run.stop is not None else policy.DATA_END), why
                break
            watchdog.progress(f"in step {run.step + 1} (forward, backward, update)", run.step)
            loss, grad_norm = self.train_step(micro_batches)
            if loss is None:  # rolled back: the run continues from the checkpoint's step, unless told to stop
                batches = iter(self.loader)
                if (stop := self.agreed_stop(worst=0)) is not None:
                    reason = stop
                    break
                continue
            run.step += 1
            run.tokens_seen += run.tokens_per_step
            self.step_metrics.step_done()
            watchdog.progress(f"after step {run.step} (metrics, monitors, validation, checkpoint)", run.step)
            now = time.perf_counter()
            run.state["wall_time_s"] += now - last  # everything since the last step, saves included
            last = now
            save_due = policy.save_due(run.step, ckpt.opts.every, run.total_steps)
            worst = self.read_skipped_steps() if is_log or save_due else 0  # the host syncs there anyway
            metrics = self.log_metrics(loss, grad_norm) if is_log else {}
            self.monitors.emit("plait_step_end", run=run, step=run.step, metrics=metrics)
            if metrics:
                consider_best(self, metrics)  # checkpoint.best_metric logged on this step (eval/...)
            if val.every and (run.step % val.every == 0 or run.step == run.total_steps):
                validate(self, val)
            ckpt.poll()
            if (stop := self.agreed_stop(worst)) is not None:
                reason = stop
                break
            if save_due and self.skipping_now:  # the last step was skipped: its state is suspect, save later
                log.warn(f"step {run.step}: the last step had a non-finite loss or gradient norm; this checkpoint is skipped")
                save_due = False
            if save_due and not self.save_checkpoint(run.step):
                reason = policy.DIVERGED
                break
        return self.finish(reason, end_detail)

    def train_step(self, micro_batches: list) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One step; monitors implementing ``plait_before_update`` may skip its update or roll
        the run back (``(None, grad_norm)``: the loop goes on from the restored step)."""
        replace = self.replace_batch if self.replace_batch_hooks else None
        loss, grad_norm, bad = self.stepper.forward_backward(micro_batches, replace, void=self.fetch.void)
        if self.before_update_hooks:
            step = self.run.step + 1
            global_loss = distributed.mean_across_ranks(loss, self.dist).item()
            norm = float(grad_norm)
            verdicts = self.monitors.emit(
                "plait_before_update", run=self.run, step=step, loss=global_loss, grad_norm=norm, clip_coef=self.stepper.clip_coef(norm)
            )
            # every rank acts on the strongest verdict of any rank's monitors (one may decide, or fail, alone)
            verdict = self.control.agree(2 if "rollback" in verdicts else int("skip" in verdicts), "max")
            if verdict == 2 and self.checkpointer.roll_back():
                return None, grad_norm
            if verdict:
                self.stepper.skip_update()
                log.info(f"step {step}: update skipped (loss {global_loss:.4f}, grad norm {norm:.3f})")
                return loss, grad_norm
        self.stepper.update(bad)
        self.checkpointer.losses.add(loss, self.run.step)  # measured on the weights after run.step: saves record it (retention)
        return loss, grad_norm

    def log_metrics(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> dict[str, Any]:
        extra = {  # whose metrics: what they returned (held to a dict of numbers by collect)
            f"precision {self.c['precision'].name!r}: metrics()": self.c["precision"].metrics(self.model),  # collectives inside
            "the model's metrics": core_metrics.model_metrics(self.model, self.dist),  # loss parts, MoE health over all ranks
            "epoch": core_metrics.epoch(self.c["data"], self.run.tokens_seen),
        }
        data_metrics = member("data", self.c["data"], "metrics")
        if data_metrics is not None:
            extra["the data source's metrics()"] = data_metrics(loader_consumed_samples(self.loader.state_dict()) or 0)
        metrics = self.step_metrics.collect(self.run, loss, grad_norm, self.stepper.lr(), self.built.loader_spec.seq_len, extra)
        metrics["skipped_steps"] = self.last_skipped
        return self.monitors.metrics(self.run, self.run.step, metrics)  # mfu, memory, update ratios...

    def read_skipped_steps(self) -> int:
        """Read the guard's counters (a host sync); warn of skipped steps; the longest run of them."""
        skipped, worst, self.skipping_now = self.guard.read()
        self.last_skipped = skipped
        if skipped and self.dist.is_main:
            log.warn(f"step {self.run.step}: {skipped} recent step(s) had a non-finite loss or gradient norm and were skipped (update not applied)")
        return worst

    # -- stages, replaced batches, rollback, validation ----------------------
    def stage_changes(self) -> bool:
        return bool(self.prep.seq_len_schedule) and self.stage_seq_len() != self.built.loader_spec.seq_len

    def stage_seq_len(self) -> int:
        """The sequence length of the next step: the last schedule entry reached, else ``data.seq_len``."""
        reached = [seq for first, seq in self.prep.seq_len_schedule if self.run.step >= first]
        return reached[-1] if reached else self.rc.seq_len

    def switch_stage(self):
        """A new sequence length: a loader for the new shape (same tokens per micro-batch), at the same data position."""
        built, seq, position = self.built, self.stage_seq_len(), self.built.state.loader.state_dict()
        self.close_loader()
        spec = built.loader_spec
        built.loader_spec = dataclasses.replace(spec, seq_len=seq, micro_batch=spec.micro_batch * spec.seq_len // seq)
        built.state.loader = prefetching(self.c["data"].loader(built.loader_spec), self.prep.grad_accum, self.dist.device)
        built.state.loader.load_state_dict(position)
        log.info(f"step {self.run.step + 1}: sequence length {seq}, micro-batch {built.loader_spec.micro_batch} (stage change)")
        return iter(built.state.loader)

    def replace_batch(self, micro: int, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``micro`` of the next step, or what the first monitor implementing
        ``plait_replace_batch`` returns instead (a spike rehearsal)."""
        for other in self.monitors.emit("plait_replace_batch", run=self.run, step=self.run.step + 1, micro=micro, inputs=inputs, labels=labels):
            if other is not None:
                return other
        return inputs, labels

    def on_checkpoint_saved(self, step: int, path: str) -> None:
        self.monitors.emit("plait_checkpoint_saved", run=self.run, step=step, path=path)

    # -- stopping ------------------------------------------------------------
    def save_checkpoint(self, step: int, use_async: bool | None = None) -> bool:
        """Save unless the state is non-finite; then ask for a stop with exit 3 and return False."""
        try:
            self.checkpointer.maybe_save(step, use_async)
            return True
        except NonFiniteState as e:
            log.error(f"{e}")
            self.run.stop = None
            self.run.request_stop(str(e), checkpoint=False, source="trainer", exit_code=EXIT_NONFINITE)
            return False

    def stop_signalled(self) -> bool:
        """Has a stop signal reached any rank? One agreement over the ranks: every rank asks together."""
        return bool(self.control.agree(int(self.signals.received is not None), "max"))

    def agreed_stop(self, worst: int) -> str | None:
        """The stop every rank agrees on at this step boundary (``worst``: non-finite steps in a row),
        ``run.stop`` made to say why on every rank; None: train on."""
        agreed = self.agree(diverged=worst > self.rc.train.max_nonfinite_steps)
        stop = policy.stop_reason(agreed)
        return None if stop is None else self.follow_stop(stop, agreed, worst)

    def agree(self, diverged: bool) -> policy.Agreed:
        """What every rank knows after this step, the same on every rank (one small all-reduce)."""
        run = self.run
        mine = policy.Agreed(
            stop_with_checkpoint=int(run.stop is not None and run.stop.checkpoint),
            stop_without_checkpoint=int(run.stop is not None and not run.stop.checkpoint),
            signal=self.signals.received or 0,
            diverged=int(diverged),
            exit_code=run.stop.exit_code if run.stop is not None else 0,
        )
        return policy.Agreed.from_list(self.control.agree(mine.as_list(), "max"))

    def follow_stop(self, reason: str, agreed: policy.Agreed, worst: int) -> str:
        """Make ``run.stop`` say why on every rank (another rank's request is followed, exit code included)."""
        run, rc = self.run, self.rc
        if reason == policy.DIVERGED:
            run.stop = None
            run.request_stop(
                f"{worst} steps in a row had a non-finite loss or gradient norm at step {run.step} "
                f"(train.max_nonfinite_steps = {rc.train.max_nonfinite_steps})",
                checkpoint=False,
                source="trainer",
                exit_code=EXIT_NONFINITE,
            )
        elif reason == policy.REQUESTED:  # once, as the run stops: the reason of the first rank that asked
            whys = self.control.agree(run.stop.reason if run.stop is not None else None, "all")
            if run.stop is None:
                by = next(r for r, why in enumerate(whys) if why is not None)
                run.request_stop(f"requested by rank {by}: {whys[by]}", checkpoint=not agreed.stop_without_checkpoint, exit_code=agreed.exit_code)
        return reason

    def finish(self, reason: str, end_detail: str) -> int:
        """The end of the run: the final save the policy asks for, the hooks, exit_status.json."""
        run, ckpt = self.run, self.checkpointer
        if run.stop is not None and reason == policy.COMPLETED and run.step < self.prep.total_steps:
            reason = policy.REQUESTED
        if reason in (policy.REQUESTED, policy.DIVERGED) and self.dist.is_main and run.stop is not None:
            log.info(f"stopping at step {run.step}: {run.stop.reason}")
        wants = run.stop is not None and run.stop.checkpoint
        if policy.final_save(reason, ckpt.opts.at_end, ckpt.opts.on_stop, wants) and not self.save_checkpoint(run.step, use_async=False):
            reason = policy.DIVERGED
        ckpt.wait()
        ckpt.finish(diverged=reason == policy.DIVERGED or (run.stop is not None and run.stop.exit_code == EXIT_NONFINITE))
        watchdog.progress("ending the run: stopping the data loader's read-ahead thread")  # teardown is watched too
        self.close_loader()
        self.monitors.emit("plait_train_end", run=run, reason=reason)
        code = run.stop.exit_code if (run.stop is not None and reason in (policy.REQUESTED, policy.DIVERGED)) else 0
        watchdog.progress(f"ending the run: writing exit_status.json (reason {reason!r})")
        recorded = "bad_input" if code == EXIT_BAD_INPUT else reason  # a stop for bad data (a file changed under the run): code 2's reason
        if self.dist.is_main:  # torchrun reports any non-zero child as 1: launchers read this file
            code = run_files.end_status(self.output_dir, code, recorded, run.step, run.stop.reason if run.stop is not None else end_detail)
        return code

    def fail(self, error: BaseException) -> None:
        """The run died of ``error``: tell the monitors (``plait_train_end`` with ``"error"``, or
        ``"signal"`` for an immediate Ctrl-C) and write ``exit_status.json``: exit code 1, or 2 for plait's one-line errors."""
        reason = "signal" if isinstance(error, KeyboardInterrupt) else "error"
        bad = isinstance(error, PlaitError)
        detail = str(error) if bad else f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        built = self.__dict__.get("built")  # None if the run died before its state existed
        run = built.state.run if built is not None else None
        if "monitors" in self.__dict__:
            self.monitors.emit("plait_train_end", run=run, reason=reason)
        if self.dist.is_main:  # a full or read-only disk: the traceback that follows says enough
            run_files.write_exit_status(
                self.output_dir, EXIT_BAD_INPUT if bad else 1, "bad_input" if bad else reason, run.step if run else 0, detail, strict=False
            )

    def save_failed(self, err: SaveFailed) -> int:
        """A checkpoint could not be written (``SaveFailed``, raised on every rank together):
        one line, ``exit_status.json`` with reason ``save_failed``, and its exit code."""
        log.error(f"{err}")
        self.monitors.emit("plait_train_end", run=self.run, reason="save_failed")
        if self.dist.is_main:  # the partial folder is gone by now, so this small file usually fits
            run_files.write_exit_status(self.output_dir, EXIT_SAVE_FAILED, "save_failed", self.run.step, str(err), strict=False)
        return EXIT_SAVE_FAILED
