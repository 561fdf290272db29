"""The training loop: build, step, log, stop cleanly.

Order of construction (torchtitan's, for one data-parallel dimension):
model on the meta device -> precision conversion (e.g. fp8 linears) ->
activation checkpointing -> torch.compile per block -> parallelism wrapper
-> materialize on the device and initialize -> optimizer and schedule.
"""

from __future__ import annotations

import gc
import json
import math
import platform
import random
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core import config as config_io
from core import distributed, log
from core import metrics as core_metrics
from core import stop_policy as policy
from core.checkpoint import Checkpointer
from core.materialize import materialize
from core.monitor_hub import MonitorHub
from core.nonfinite import EXIT_NONFINITE, NonFiniteGuard, NonFiniteState
from core.parallelize import parallelize
from core.param_groups import param_groups
from core.prepare import Prepared
from core.protocols import DistInfo, LoaderSpec, loader_may_end
from core.run import Run

SPIKE_BATCHES = 5  # steps of rare-token batches injected by train.inject_spike_at_step
# One Ctrl-C can reach a rank more than once (directly from the terminal, and forwarded by the
# launcher): signals within this many seconds of the first are the same stop; a Ctrl-C after
# it stops at once.
SIGNAL_WINDOW_S = 3.0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def library_versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("plait", "torchao", "torchdata", "numpy", "pluggy", "safetensors"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
    from core.registry import load

    for plugin, version in load().third_party.items():  # third-party plugins: "distribution version"
        out[f"plugin:{plugin}"] = version
    return out


class Trainer:
    def __init__(self, prep: Prepared, dist: DistInfo) -> None:
        self.prep = prep
        self.dist = dist
        self.rc = prep.rc
        self.c = prep.components
        self.output_dir = Path(self.rc.train.output_dir)
        self._signal: int | None = None
        self._signal_t = 0.0

    # -- construction --------------------------------------------------------
    def build(self) -> None:
        """Everything the loop needs, resumed from the first candidate checkpoint that every
        rank finds sound and that loads (:mod:`core.resume`); a load that fails half-way is
        followed by a fresh build of the state before the next candidate (or a fresh start)."""
        from core import resume

        rc, dist = self.rc, self.dist
        if rc.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.control = distributed.ControlPlane(dist)
        self.check_precision_agrees()
        self.versions = library_versions()
        self.checkpointer = Checkpointer(self.rc.sections["checkpoint"], self.prep.checkpoint_root, self)
        candidates = list(self.prep.resume_candidates)
        model_meta = self.meta_model() if candidates else None
        while True:
            path, candidates = resume.first_sound(self.checkpointer, candidates, model_meta)
            self.build_state(initial_load=path is None)
            if path is None or resume.restore(self.checkpointer, path, last=not candidates):
                break
            self.release_state()
        self.monitors = MonitorHub([(m.component.name, m.instantiate()) for m in self.rc.monitors],
                                   self.rc.monitors_options.on_error)
        self._before_update = self.monitors.implements("plait_before_update")

    def meta_model(self) -> torch.nn.Module:
        with torch.device("meta"):
            return self.c["model"].build()  # precision conversions keep parameter names

    def check_precision_agrees(self) -> None:
        if self.rc.precision_chain:  # every rank must have made the same choice
            names = [ch.component.name for ch in self.rc.precision_chain]
            mine = names.index(self.rc.slots["precision"].component.name)
            hi, neg_lo = self.control.max([mine, -mine])
            if hi != -neg_lo:
                raise RuntimeError(f"ranks chose different precisions from {names}: devices differ between ranks")

    def release_state(self) -> None:
        """Drop the model, optimizer, loader and run state (before building them again)."""
        self.model = self.train_model = self.optimizer = self.scheduler = self.loader = self.run = None
        self.update_ratio = self.guard = None
        gc.collect()

    def build_state(self, initial_load: bool) -> None:
        """The seeded model, optimizer, schedule, loader and run state, as a fresh run has them;
        ``initial_load``: with the weights of ``checkpoint.initial_load``, if set."""
        rc, c, dist = self.rc, self.c, self.dist
        seed_everything(rc.train.seed)
        spec, precision, parallelism = c["model"], c["precision"], c["parallelism"]
        with torch.device("meta"):
            model = spec.build()
        model = precision.convert(model, spec)
        materialize(model, dist.device)  # weight ties kept
        with torch.no_grad():
            spec.init_weights(model)
        initial = rc.sections["checkpoint"].initial_load
        if initial and initial_load:
            from core.weights import copy_into, load_weights

            copy_into(model, load_weights(Path(initial), spec, model))
            if dist.is_main:
                log.info(f"initial weights from {initial}")
        self.model = model
        self.train_model = parallelize(model, spec, parallelism, precision, dist, rc.train)
        if self.prep.micro_batch_candidates:
            self.choose_micro_batch()
        self.optimizer = c["optimizer"].build(param_groups(self.model, c["optimizer"].options))
        total = self.prep.total_steps
        schedule = c["lr_schedule"]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: schedule.multiplier(s, total)
        )
        self.loader_spec = LoaderSpec(
            seq_len=rc.seq_len,
            micro_batch=rc.train.micro_batch,
            grad_accum=self.prep.grad_accum,
            dp_rank=dist.dp_rank,
            dp_size=dist.dp_size,
            seed=rc.train.seed,
            total_samples=total * rc.train.global_batch_tokens // rc.seq_len,
        )
        self.loader = c["data"].loader(self.loader_spec)
        self._post_optimizer_step = getattr(precision, "post_optimizer_step", None)
        self._before_update = False  # set once the monitors exist
        self.update_ratio = core_metrics.UpdateRatio(self.optimizer)
        self.guard = NonFiniteGuard(self.optimizer, dist)
        self.last_skipped = 0  # steps skipped (non-finite) in the last log window
        self.skipping_now = 0  # steps skipped in a row up to the last read
        self.applied_lr = self.optimizer.param_groups[0]["lr"]
        self._measure_update = False
        self.data_wait_s = 0.0
        self.flops_per_token = spec.flops_per_token(rc.seq_len)
        self.run = Run(
            config=self.prep.resolved,
            output_dir=self.output_dir,
            dist=dist,
            total_steps=total,
            tokens_per_step=self.prep.tokens_per_step,
            model=self.model,
            spec=spec,
            optimizer=self.optimizer,
            state={"wall_time_s": 0.0, "best_val_loss": math.inf},
        )
        # The run's lineage: checkpoints record it, pruning only touches its own; a resume carries it on.
        self.run.state["lineage"] = self.control.broadcast_object(uuid.uuid4().hex)

    def choose_micro_batch(self) -> None:
        """``micro_batch = "auto"``: probe on CUDA, agree across ranks, re-derive accumulation."""
        from core.micro_batch import probe
        from core.run_config import batch_layout

        rc, prep, dist = self.rc, self.prep, self.dist
        micro = rc.train.micro_batch
        if dist.device.type == "cuda":
            n_params = sum(p.numel() for p in self.model.parameters())
            state = int(getattr(self.c["optimizer"], "state_bytes_per_param", 8) * n_params)
            micro = probe(self.train_model, self.c["precision"], dist.device, prep.micro_batch_candidates,
                          rc.seq_len, self.c["model"].vocab_size, state)
            micro = -distributed.ControlPlane(dist).max([-micro])[0]  # the smallest rank's answer
        rc.train.micro_batch = micro
        prep.grad_accum = batch_layout(rc.train.global_batch_tokens, micro, rc.seq_len, dist.world_size)
        if dist.is_main:
            log.info(f"micro_batch = \"auto\" chose {micro} (accumulation {prep.grad_accum}) on {dist.device}")

    def seq_len_for(self, step: int) -> int:
        """The sequence length of ``data.seq_len_stages`` at this step (0-based), else data.seq_len."""
        seq = self.rc.seq_len
        for start, stage_seq in self.rc.core_keys["data"].get("seq_len_stages", []):
            if step >= start * self.run.total_steps:
                seq = stage_seq
        return seq

    def switch_seq_len(self, seq: int):
        """A new stage: same tokens per micro-batch, the data position carried over."""
        import dataclasses

        spec = self.loader_spec
        micro = spec.micro_batch * spec.seq_len // seq
        position = self.loader.state_dict()
        self.loader_spec = dataclasses.replace(spec, seq_len=seq, micro_batch=micro)
        self.loader = self.c["data"].loader(self.loader_spec)
        self.loader.load_state_dict(position)
        self.flops_per_token = self.c["model"].flops_per_token(seq)
        log.info(f"step {self.run.step + 1}: sequence length {seq}, micro-batch {micro} (stage change)")
        return iter(self.loader)

    def spike_due(self) -> bool:
        """Is this step inside the injected spike? Keyed on the data position, not the step
        number, so a rollback (which keeps the data position) does not replay it."""
        inject = self.rc.train.inject_spike_at_step
        if inject <= 0:
            return False
        consumed = self.loader.state_dict().get("consumed_samples")
        if consumed is None:
            return inject <= self.run.step + 1 < inject + SPIKE_BATCHES
        per_step = self.loader_spec.global_batch
        return (inject - 1) * per_step <= consumed < (inject - 1 + SPIKE_BATCHES) * per_step

    def spike_batch(self, shape, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A rehearsal spike: tokens from the top 1% of the id range (the rarest in a BPE vocabulary),
        a pure function of (seed, step, rank, micro-step); the real batch is consumed and dropped."""
        vocab = self.c["model"].vocab_size
        low = max(0, vocab - max(vocab // 100, 2))
        g = torch.Generator().manual_seed(self.rc.train.seed * 1_000_003 + self.run.step * 1009 + self.dist.rank * 31 + micro)
        rows = torch.randint(low, vocab, (shape[0], shape[1] + 1), generator=g)
        if micro == 0 and self.dist.is_main:
            log.info(f"step {self.run.step + 1}: injected spike batch (train.inject_spike_at_step)")
        return rows[:, :-1], rows[:, 1:]

    def rollback(self) -> bool:
        """Restore the last complete checkpoint but keep the data position. False if there is none."""
        from core.checkpoint import committed, lineage_of

        done = [p for p in committed(self.checkpointer.root) if lineage_of(p) == self.checkpointer.lineage]
        if not done:
            log.info("rollback asked, but there is no checkpoint yet: skipping the update instead")
            return False
        self.checkpointer.wait()
        position = self.loader.state_dict()
        wall = self.run.state.get("wall_time_s", 0.0)
        self.optimizer.zero_grad(set_to_none=True)
        skip = set(self.checkpointer.opts.exclude_from_loading)
        self.checkpointer.opts.exclude_from_loading = sorted(skip | {"data"})
        try:
            self.checkpointer.load(done[-1])
        finally:
            self.checkpointer.opts.exclude_from_loading = sorted(skip)
        self.loader.load_state_dict(position)
        self.run.state["wall_time_s"] = wall  # time keeps counting (budgets)
        log.info(f"rolled back to {done[-1].name}; the data since then is skipped")
        return True

    def validate(self, opts) -> None:
        from core.validation import evaluate

        loss = evaluate(self, opts)
        best = min(self.run.state.get("best_val_loss", math.inf), loss)
        self.run.state["best_val_loss"] = best
        self.monitors.emit("plait_validation_end", run=self.run, step=self.run.step,
                           metrics={"val_loss": loss, "best_val_loss": best})
        keep = self.checkpointer.opts.keep_best
        ranking = self.run.state.setdefault("best_checkpoints", [])  # [[val_loss, step], ...] best first
        if keep and (len(ranking) < keep or loss < ranking[-1][0]):  # the loss is a global mean: every rank agrees
            ranking[:] = sorted(ranking + [[loss, self.run.step]])[:keep]
            self.checkpointer.save_best(self.run.step)

    def on_checkpoint_saved(self, step: int, path: str) -> None:
        self.monitors.emit("plait_checkpoint_saved", run=self.run, step=step, path=path)

    def fail(self, error: BaseException) -> None:
        """The run died of ``error``: tell the monitors (``plait_train_end`` with ``"error"``, or
        ``"signal"`` for an immediate Ctrl-C) and write ``exit_status.json`` with exit code 1."""
        reason = "signal" if isinstance(error, KeyboardInterrupt) else "error"
        detail = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        monitors = getattr(self, "monitors", None)
        if monitors is not None:
            monitors.emit("plait_train_end", run=self.run, reason=reason)
        if self.dist.is_main:
            try:
                self.output_dir.mkdir(parents=True, exist_ok=True)
                status = {"exit_code": 1, "reason": reason, "step": self.run.step if hasattr(self, "run") else 0, "detail": detail}
                (self.output_dir / "exit_status.json").write_text(json.dumps(status) + "\n")
            except OSError:
                pass  # a full or read-only disk: the traceback that follows says enough

    def summary(self) -> str:
        """What is active, in a few lines: printed once at start (rank 0)."""
        rc, prep = self.rc, self.prep
        name = lambda slot: rc.slots[slot].component.name  # noqa: E731
        params = sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())
        reasons = "; ".join(f"{k}: {v}" for k, v in rc.precision_reasons.items()) if rc.precision_chain else ""
        precision = name("precision") + (f" (fallback skipped {reasons})" if reasons else "")
        train = rc.train
        ac = train.activation_checkpointing + (f" every {train.activation_checkpointing_every}" if train.activation_checkpointing == "full" and train.activation_checkpointing_every > 1 else "")
        return "\n".join([
            f"plait: model {name('model')}, {params:,} parameters | {name('parallelism')} on {self.dist.world_size} rank(s), "
            f"{self.dist.device} | precision {precision}",
            f"plait: activation checkpointing {ac} | compile {'on' if train.compile else 'off'} | optimizer "
            f"{name('optimizer')} | schedule {name('lr_schedule')} | data {name('data')}",
            f"plait: batch {train.micro_batch} micro x {rc.seq_len} seq x {self.dist.world_size} ranks x {prep.grad_accum} "
            f"accumulation = {prep.tokens_per_step:,} tokens/step | steps {self.run.step} -> {self.run.total_steps}",
        ])

    def write_run_files(self) -> None:
        if not self.dist.is_main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.resolved.toml").write_text(config_io.dumps(self.prep.resolved))
        info = {
            "config": self.prep.source,
            "command": sys.argv,
            "world_size": self.dist.world_size,
            "device": str(self.dist.device),
            "device_name": torch.cuda.get_device_name(self.dist.device) if self.dist.device.type == "cuda" else platform.processor() or platform.machine(),
            "backend": self.dist.backend,
            "versions": self.versions,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (self.output_dir / "run_info.json").write_text(json.dumps(info, indent=2) + "\n")

    def save_failed(self, err: Exception) -> int:
        """A checkpoint could not be written (``SaveFailed``, raised on every rank together):
        one line, ``exit_status.json`` with reason ``save_failed``, and its exit code."""
        from core.checkpoint import EXIT_SAVE_FAILED

        log.error(f"{err}")
        self.monitors.emit("plait_train_end", run=self.run, reason="save_failed")
        if self.dist.is_main:  # the partial folder is gone by now, so this small file usually fits
            status = {"exit_code": EXIT_SAVE_FAILED, "reason": "save_failed", "step": self.run.step, "detail": str(err)}
            try:
                self.output_dir.mkdir(parents=True, exist_ok=True)
                (self.output_dir / "exit_status.json").write_text(json.dumps(status) + "\n")
            except OSError as e:
                log.error(f"cannot write exit_status.json either ({e})")
        return EXIT_SAVE_FAILED

    # -- signals -------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if self._signal is not None:
            if signum == signal.SIGINT and time.monotonic() - self._signal_t > SIGNAL_WINDOW_S:
                raise KeyboardInterrupt  # a deliberate second Ctrl-C stops at once
            return  # the same stop, delivered again (terminal and launcher)
        self._signal = signum
        self._signal_t = time.monotonic()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    # -- the loop ------------------------------------------------------------
    def next_step_batches(self, batches) -> tuple[list | None, str]:
        """This step's micro-batches, fetched before any compute: ``(batches, "")``, or
        ``(None, why)`` when the data has run out on any rank. Loaders whose end can differ
        between ranks (``may_end``) cost one all-reduce per step; sources that end
        deterministically raise :class:`DataExhausted` on every rank at the same step.
        A bad record found mid-run (:class:`DataError`: a line past the ones checked at start)
        stops every rank with a checkpoint and exit code 2, naming the file and line."""
        from core.data import DataExhausted
        from core.errors import DataError

        t_wait = time.perf_counter()
        micro, why, bad = [], "", 0
        try:
            for _ in range(self.prep.grad_accum):
                micro.append(next(batches))
        except DataExhausted as e:
            why = str(e)
        except StopIteration:
            why = "[data] the source reached the end of its data"
        except DataError as e:
            why, bad = f"bad data: {e}", 2
            log.error(f"rank {self.dist.rank}: {why}; stopping with a checkpoint of step {self.run.step}", all_ranks=True)
        self.data_wait_s += time.perf_counter() - t_wait
        if loader_may_end(self.loader):
            ended, bad = self.control.max([int(bool(why)), bad])
            if ended and not why:
                why = "bad data on another rank" if bad else "the data ran out on another rank"
        if bad:
            self.run.request_stop(why, checkpoint=True, source="data", exit_code=2)
        return (None, why) if why else (micro, "")

    def train_step(self, micro_batches: list, spiking: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        c, dev = self.c, self.dist.device
        accum = self.prep.grad_accum
        loss_sum = torch.zeros((), device=dev)
        for m, (inputs, labels) in enumerate(micro_batches):
            if spiking:
                inputs, labels = self.spike_batch(inputs.shape, m)
            inputs = inputs.to(dev, non_blocking=True)
            labels = labels.to(dev, non_blocking=True)
            with c["parallelism"].sync_context(self.train_model, sync=m == accum - 1):
                with c["precision"].autocast(dev):
                    loss = self.train_model(inputs, labels)
                (loss / accum).backward()
            loss_sum += loss.detach()
        grad_norm = c["parallelism"].clip_grad_norm(self.train_model, self.rc.train.grad_clip)
        bad = self.guard.flag(loss_sum, grad_norm)  # NaN/inf on any rank: no update (no host sync)
        if self._before_update:
            step = self.run.step + 1
            global_loss = distributed.mean_across_ranks(loss_sum / accum, self.dist).item()
            verdicts = self.monitors.emit("plait_before_update", run=self.run, step=step, loss=global_loss,
                                          grad_norm=float(grad_norm))
            if "rollback" in verdicts and self.rollback():
                return None, grad_norm
            if "skip" in verdicts or "rollback" in verdicts:
                self.optimizer.zero_grad(set_to_none=True)
                self.scheduler.step()
                log.info(f"step {step}: update skipped (loss {global_loss:.4f}, grad norm {float(grad_norm):.3f})")
                return loss_sum / accum, grad_norm
        if self._measure_update:
            self.update_ratio.before()
        lr = self.optimizer.param_groups[0]["lr"]  # this step's LR: the scheduler moves it on after the update
        self.applied_lr = lr.clone() if isinstance(lr, torch.Tensor) else lr
        self.guard.step(self.optimizer, bad)
        if self._post_optimizer_step is not None:
            self._post_optimizer_step(self.model)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum / accum, grad_norm

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

    def log_metrics(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, steps_in_window: int, window_s: float) -> dict[str, Any]:
        run = self.run
        loss_avg = distributed.mean_across_ranks(loss, self.dist).item()
        elapsed = run.state["wall_time_s"]
        per_step = window_s / max(steps_in_window, 1)
        metrics: dict[str, Any] = {
            "step": step,
            "loss": loss_avg,
            "grad_norm": float(grad_norm.item()),
            "lr": float(self.applied_lr) / self.optimizer.param_groups[0].get("lr_mult", 1.0),
            "tokens_seen": run.tokens_seen,
            "tokens_per_s": run.tokens_per_step * steps_in_window / max(window_s, 1e-9),
            "step_time_s": per_step,
            "elapsed_s": elapsed,
            "eta_s": per_step * (run.total_steps - step),
        }
        per_device = metrics["tokens_per_s"] / self.dist.world_size
        metrics["tokens_per_s_per_device"] = per_device
        metrics["seq_len"] = self.loader_spec.seq_len
        value = core_metrics.mfu(per_device, self.flops_per_token, self.dist.device)
        metrics["mfu"] = value if value is not None else "n/a"
        peak = core_metrics.peak_flops(self.dist.device)
        metrics["peak_tflops"] = peak / 1e12 if peak is not None else "n/a"
        metrics["data_wait_s"] = self.data_wait_s / max(steps_in_window, 1)
        self.data_wait_s = 0.0
        metrics.update(core_metrics.memory(self.dist.device))
        metrics.update(self.update_ratio.after())
        metrics.update(self.c["precision"].metrics(self.model))
        model_metrics = getattr(self.model, "extra_metrics", None)  # loss parts, MoE health (rank 0's view)
        if model_metrics is not None:
            metrics.update(model_metrics())
        data_metrics = getattr(self.c["data"], "metrics", None)
        if data_metrics is not None:
            metrics.update(data_metrics(self.loader.state_dict().get("consumed_samples", 0)))
        return metrics

    def fit(self) -> int:
        """Train to ``run.total_steps``: fetch, step, count, log, validate, decide, save."""
        run, rc, ckpt = self.run, self.rc, self.checkpointer
        self.monitors.emit("plait_train_start", run=run)
        batches = iter(self.loader)
        log_every, every = rc.train.log_every, ckpt.opts.every
        reason, end_detail = policy.COMPLETED, ""
        if self.control.max([int(run.stop is not None)])[0]:  # a monitor failed to start: every rank stops
            run.request_stop("a monitor failed at train start", checkpoint=False, exit_code=4)
            run.total_steps = run.step
        window_t0, window_steps = time.perf_counter(), 0
        last = time.perf_counter()
        while run.step < run.total_steps:
            if self.seq_len_for(run.step) != self.loader_spec.seq_len:
                batches = self.switch_seq_len(self.seq_len_for(run.step))
            self._measure_update = policy.is_log_step(run.step + 1, log_every, run.total_steps)
            spiking = self.spike_due()  # keyed on the data position before this step's batches
            micro_batches, why = self.next_step_batches(batches)
            if micro_batches is None:
                log.info(f"{why}; ending the run after step {run.step}")
                reason, end_detail = (policy.REQUESTED if run.stop is not None else policy.DATA_END), why
                break
            loss, grad_norm = self.train_step(micro_batches, spiking)
            if loss is None:  # rolled back: the run continues from the checkpoint's step
                batches = iter(self.loader)
                continue
            run.step += 1
            run.tokens_seen += run.tokens_per_step
            window_steps += 1
            now = time.perf_counter()
            run.state["wall_time_s"] += now - last  # everything since the last step, saves included
            last = now
            is_log = policy.is_log_step(run.step, log_every, run.total_steps)
            save_due = policy.save_due(run.step, every, run.total_steps)
            worst = self.read_skipped_steps() if is_log or save_due else 0  # the host syncs there anyway
            metrics: dict[str, Any] = {}
            if is_log:
                metrics = self.log_metrics(run.step, loss, grad_norm, window_steps, now - window_t0)
                metrics["skipped_steps"] = self.last_skipped
                window_t0, window_steps = time.perf_counter(), 0
            self.monitors.emit("plait_step_end", run=run, step=run.step, metrics=metrics)
            val = rc.sections["validation"]
            if val.every and (run.step % val.every == 0 or run.step == run.total_steps):
                self.validate(val)
            ckpt.poll()
            agreed = self.agree(diverged=worst > rc.train.max_nonfinite_steps)
            stop = policy.stop_reason(agreed)
            if stop is not None:
                reason = self.follow_stop(stop, agreed, worst)
                break
            if save_due and self.skipping_now:  # the last step was skipped: its state is suspect, save later
                log.warn(f"step {run.step}: the last step had a non-finite loss or gradient norm; this checkpoint is skipped")
                save_due = False
            if save_due and not self.save_checkpoint(run.step):
                reason = policy.DIVERGED
                break
        return self.finish(reason, end_detail)

    def read_skipped_steps(self) -> int:
        """Read the guard's counters (a host sync); warn of skipped steps; the longest run of them."""
        skipped, worst, self.skipping_now = self.guard.read()
        self.last_skipped = skipped
        if skipped and self.dist.is_main:
            log.warn(f"step {self.run.step}: {skipped} recent step(s) had a non-finite loss or gradient "
                  "norm and were skipped (update not applied)")
        return worst

    def agree(self, diverged: bool) -> policy.Agreed:
        """What every rank knows after this step, the same on every rank (one small all-reduce)."""
        run = self.run
        mine = policy.Agreed(
            stop_with_checkpoint=int(run.stop is not None and run.stop.checkpoint),
            stop_without_checkpoint=int(run.stop is not None and not run.stop.checkpoint),
            signal=self._signal or 0,
            diverged=int(diverged),
            exit_code=run.stop.exit_code if run.stop is not None else 0,
        )
        return policy.Agreed.from_list(self.control.max(mine.as_list()))

    def follow_stop(self, reason: str, agreed: policy.Agreed, worst: int) -> str:
        """Make ``run.stop`` say why on every rank (another rank's request is followed, exit code included)."""
        run, rc = self.run, self.rc
        if reason == policy.DIVERGED:
            run.stop = None
            run.request_stop(f"{worst} steps in a row had a non-finite loss or gradient norm at step {run.step} "
                             f"(train.max_nonfinite_steps = {rc.train.max_nonfinite_steps})",
                             checkpoint=False, source="trainer", exit_code=EXIT_NONFINITE)
        elif reason == policy.REQUESTED and run.stop is None:
            run.request_stop("requested by another rank", checkpoint=not agreed.stop_without_checkpoint,
                             exit_code=agreed.exit_code)
        return reason

    def finish(self, reason: str, end_detail: str) -> int:
        """The end of the run: the final save the policy asks for, the hooks, exit_status.json."""
        run, ckpt = self.run, self.checkpointer
        if run.stop is not None and reason == policy.COMPLETED and run.step < self.prep.total_steps:
            reason = policy.REQUESTED
        if reason in (policy.REQUESTED, policy.DIVERGED) and self.dist.is_main and run.stop is not None:
            log.info(f"stopping at step {run.step}: {run.stop.reason}")
        wants = run.stop is not None and run.stop.checkpoint
        if policy.final_save(reason, ckpt.opts.at_end, ckpt.opts.on_stop, wants) and \
                not self.save_checkpoint(run.step, use_async=False):
            reason = policy.DIVERGED
        ckpt.wait()
        self.monitors.emit("plait_train_end", run=run, reason=reason)
        code = run.stop.exit_code if (run.stop is not None and reason in (policy.REQUESTED, policy.DIVERGED)) else 0
        if self.dist.is_main:  # torchrun reports any non-zero child as 1: launchers read this file
            status = {"exit_code": code, "reason": reason, "step": run.step,
                      "detail": run.stop.reason if run.stop is not None else end_detail}
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "exit_status.json").write_text(json.dumps(status) + "\n")
        return code
