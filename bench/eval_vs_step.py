"""One in-loop evaluation pass against one training step, on a shipped config, with ``core.plan``'s estimate beside it.

For each config (``train_configs/``, the Shakespeare corpus that ships with plait as data, on the
CPU, fp32, one process): a real :class:`core.loop.trainer.Trainer` with the ``downstream`` monitor
on a small local task file (``--items`` examples cut from the corpus's validation text: a
``--context``-byte context, four ``--continuation``-byte choices, the true one gold) and
``[validation]`` (``--val-batches`` micro-batches). Untimed: one step and one pass. Then
``--rounds`` rounds, each timing in turn one training step (fetch, forward, backward, update, as
``fit()`` runs it), one ``downstream`` pass (its ``plait_metrics`` at a due step) and one validation
pass; medians. The plan's ratio is :mod:`core.cli.plan_eval`'s: the pass's forward FLOPs over the
step's FLOPs (what ``core.plan`` adds to the ETA per pass).

    python -m bench.eval_vs_step --configs debug_cpu 50m_a100 --rounds 3 --record
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import REPO, report, table
from core.cli.plan_eval import forward_flops, planned
from core.contract.protocols import DistInfo
from core.loop.trainer import Trainer
from core.loop.validation import validate
from core.preflight.prepare import prepare

CORPUS = REPO / "plugins" / "data" / "corpus" / "shakespeare"


def task_file(path: Path, items: int, context: int, continuation: int) -> Path:
    """``items`` examples cut from the corpus's validation text (bytes): a context and four choices, the true continuation gold."""
    text = bytes(np.fromfile(CORPUS / "val.bin", dtype=json.loads((CORPUS / "meta.json").read_text()).get("dtype", "uint16")).astype(np.uint8)).decode(
        "utf-8", "replace"
    )
    span = context + continuation
    lines = []
    for i in range(items):
        at = i * 5 * span
        ctx, gold = text[at : at + context], text[at + context : at + span]
        wrong = [text[at + k * span : at + k * span + continuation] for k in (2, 3, 4)]
        lines.append(json.dumps({"context": ctx, "continuations": [gold, *wrong], "gold": 0}))
    path.write_text("\n".join(lines) + "\n")
    return path


def overrides(config: str, task: Path, out: str, a) -> list[str]:
    """The config on this CPU: the shipped corpus, fp32, one process, the monitor and validation on, nothing saved."""
    small = ["--train.micro_batch=1", "--train.global_batch_tokens=1024", "--train.target_tokens=0"] if config.startswith("50m") else []
    return [
        *small,
        "--train.steps=1000",
        "--train.device=cpu",
        "--train.log_every=10",
        f"--train.output_dir={out}",
        f"--data.path={CORPUS}",
        "--precision.name=fp32",
        '--monitors.enabled=["downstream"]',
        f'--monitors.downstream.tasks=["{task}"]',
        "--monitors.downstream.every=10",
        "--validation.every=10",
        f"--validation.batches={a.val_batches}",
        "--checkpoint.at_end=false",
        "--checkpoint.resume=none",
    ]


def measure(config: str, a, folder: Path) -> dict:
    task = task_file(folder / "task.jsonl", a.items, a.context, a.continuation)
    prep = prepare(str(REPO / "train_configs" / f"{config}.toml"), overrides(config, task, str(folder / config), a))
    spec = prep.components["model"]
    step_flops = prep.tokens_per_step * spec.flops_per_token(prep.rc.seq_len)
    plan = {name: forward_flops(answer["cost"], spec.flops_per_token) for name, answer in planned(prep)}
    trainer = Trainer(prep, DistInfo(device=torch.device("cpu")))
    trainer.build()
    run, val = trainer.run, prep.rc.sections["validation"]
    trainer.monitors.emit("plait_train_start", run=run)
    downstream = trainer.monitors.pm.get_plugin("downstream")
    batches = iter(trainer.loader)

    def step() -> None:
        micro, _ = trainer.fetch.fetch(batches, trainer.built.loader_spec)
        trainer.train_step(micro)
        run.step += 1

    def downstream_pass() -> None:
        assert downstream.plait_metrics(run, 10) is not None  # a due step

    def validation_pass() -> None:
        validate(trainer, val)

    parts = {"step": step, "downstream": downstream_pass, "validation": validation_pass}
    for fn in parts.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(a.rounds):
        for name, fn in parts.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "config": config,
        "tokens_per_step": prep.tokens_per_step,
        "med": med,
        "measured_ratio": (med["downstream"] + med["validation"]) / med["step"],
        "plan_ratio": (plan["downstream"] + plan["validation"]) / step_flops,
        "forward_tokens": {name: answer["cost"].tokens for name, answer in planned(prep)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["debug_cpu", "50m_a100"], help="names in train_configs/")
    p.add_argument("--items", type=int, default=16, help="task examples (four choices each)")
    p.add_argument("--context", type=int, default=192, help="context bytes (tokens) per example")
    p.add_argument("--continuation", type=int, default=48, help="bytes (tokens) per choice")
    p.add_argument("--val-batches", type=int, default=2, help="validation.batches")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--record", action="store_true", help="append the figures to bench/results.jsonl")
    a = p.parse_args()
    load = [os.getloadavg()[0]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in a.configs:
            r = measure(config, a, Path(tmp))
            m = r["med"]
            rows.append(
                [
                    f"`{r['config']}`, {r['tokens_per_step']:,} tokens/step",  # a setting, part of the row's name
                    m["step"] * 1000,
                    m["downstream"] * 1000,
                    m["validation"] * 1000,
                    r["measured_ratio"],
                    r["plan_ratio"],
                ]
            )
            print(r, flush=True)
    load.append(os.getloadavg()[0])
    body = table(["config", "step ms", "downstream pass ms", "validation pass ms", "pass / step (x)", "core.plan's pass / step (x)"], rows)
    print(body)
    if a.record:
        note = (
            f"{a.items} task examples x 4 choices ({a.context}-byte contexts, {a.continuation}-byte choices, bytes tokens), "
            f"validation.batches = {a.val_batches}; 50m at 1 x 1024 tokens/step (not its 524,288); fp32, 1 process; "
            f"{a.rounds} alternating rounds after a warm-up, medians; shared loaded machine: load average (1 min) {load[0]:.2f} at the start, {load[1]:.2f} at the end"
        )
        report("in-loop evaluation pass vs training step", body, device="cpu", note=note)


if __name__ == "__main__":
    main()
