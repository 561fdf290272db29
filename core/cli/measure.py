"""``python -m core.plan --measure``: a few real training steps of a config, timed on this machine.

One process, plait's own Trainer; checkpoints, validation and monitors are off, and the run's
output and checkpoint folders are never touched (a temporary folder stands in). The plan turns
the measured tokens per second into its ETA and cost.
"""

from __future__ import annotations

import contextlib
import platform
import sys
import tempfile
import time
from typing import Any

import torch

from core.contract.errors import DataError


# Overrides for a measurement: one process, nothing written to the run's folders, no checkpoints
# or validation, no initial weights (measure() also drops the monitors, a spike rehearsal with them).
def _measure_overrides(tmp: str) -> list[str]:
    return [
        f"--train.output_dir={tmp}/out",
        f"--checkpoint.dir={tmp}/checkpoints",
        "--checkpoint.resume=none",
        "--checkpoint.every=0",
        "--checkpoint.keep_best=0",
        "--checkpoint.initial_load=@default",
        "--validation.every=0",
    ]


def measure(config: str, overrides: list[str], warmup: int, steps: int) -> dict[str, Any]:
    """Tokens per second of this config on one process on this machine: ``warmup`` training
    steps, then ``steps`` timed ones (data loading, forward, backward and optimizer step), with
    plait's own Trainer. Checkpoints, validation and monitors are off and the run's output and
    checkpoint folders are not touched (a temporary folder stands in). Anything the trainer
    prints goes to stderr, so ``--json`` stays clean."""
    from core.contract.protocols import DistInfo
    from core.loop.trainer import Trainer
    from core.preflight.prepare import prepare

    with tempfile.TemporaryDirectory(prefix="plait-measure-") as tmp, contextlib.redirect_stdout(sys.stderr):
        with contextlib.redirect_stderr(_Discard()):  # the plan's own prepare has printed its warnings already
            prep = prepare(config, [*overrides, *_measure_overrides(tmp)], world_size=1, validate_data=False, dry_run=True)
        prep.rc.monitors = []  # checked by prepare (their sections stay valid), never run
        spec = prep.components["model"]
        prep.components["data"].validate(spec.vocab_size, prep.rc.seq_len)
        device = prep.device
        trainer = Trainer(prep, DistInfo(rank=0, world_size=1, local_rank=0, device=device, backend="none"))
        trainer.build()
        batches = iter(trainer.loader)

        def one_step() -> None:
            micro, why = trainer.fetch.fetch(batches, trainer.built.loader_spec)
            if micro is None:
                raise DataError(f"--measure: {why} after {trainer.run.step} steps")
            trainer.train_step(micro)
            trainer.run.step += 1

        for _ in range(warmup):
            one_step()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            one_step()
        _sync(device)
        seconds = time.perf_counter() - t0
        tokens = steps * prep.tokens_per_step
        name = (
            torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        )
        result = {
            "processes": 1,
            "device": f"{device}: {name}",
            "warmup_steps": warmup,
            "timed_steps": steps,
            "tokens_per_step": prep.tokens_per_step,
            "micro_batch": prep.rc.train.micro_batch,
            "grad_accum": prep.grad_accum,
            "seq_len": prep.rc.seq_len,
            "seconds": seconds,
            "tokens_per_s_per_device": tokens / seconds,
        }
        trainer = None  # type: ignore[assignment]  # free the model before the temporary folder goes
    return result


class _Discard:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
