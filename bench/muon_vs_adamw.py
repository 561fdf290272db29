"""Muon against AdamW side by side: the same model, data, steps and tokens, in one process.

The llama3 ``--flavor`` (fp32) from the same seed trains ``--steps`` steps on the same
batches of the shipped Shakespeare corpus (``--micro-batch`` rows of ``--seq-len`` tokens, one
micro-batch per step, gradient norm clipped to 1.0, constant LR: no schedule) with each
optimizer plugin built through the registry at its defaults (``adamw``: lr 3e-4; ``muon``:
lr 0.02 on the hidden matrices, AdamW at 3e-4 on the rest), the core's parameter groups.
``--rounds`` alternating rounds (the order flips each round); reported: the loss at equal
steps, the median step time (forward, backward, clip and update) and the median
``optimizer.step()`` time over the steps after the first of every round.

    python -m bench.muon_vs_adamw --flavor 50m
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.common import REPO, report, table

OPTIMIZERS = ("adamw", "muon")


def train(name: str, flavor: str, steps: int, seq_len: int, micro_batch: int) -> tuple[list[float], list[float], list[float]]:
    """(losses, step seconds, optimizer.step() seconds) of one run."""
    import numpy as np
    import torch

    from core.config import registry
    from core.contract.option_values import build_options
    from core.contract.param_groups import param_groups
    from core.contract.protocols import output_head_params
    from model_specs.llama3.spec import Llama3Spec
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    torch.manual_seed(0)
    spec = Llama3Spec.from_flavor(flavor)
    model = spec.build()
    spec.init_weights(model)
    data = TokenBin(TokenBinOptions(path=str(REPO / "plugins" / "data" / "corpus" / "shakespeare")))
    component = registry.load().get("optimizer", name, "bench")
    opts = build_options(component.options, {}, f"[optimizer] {name}")
    builder = component.factory(opts)
    head = output_head_params(spec, model) if getattr(builder, "separate_output_head", False) else ()
    optimizer = builder.build(param_groups(model, opts, head))
    losses, step_s, opt_s = [], [], []
    for step in range(steps):
        start = time.perf_counter()
        rows = torch.from_numpy(np.stack([data.sample(step * micro_batch + j, seq_len, "train") for j in range(micro_batch)]))
        loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        mid = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        losses.append(loss.item())
        step_s.append(end - start)
        opt_s.append(end - mid)
    return losses, step_s, opt_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="50m")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    import torch

    losses: dict[str, list[list[float]]] = {k: [] for k in OPTIMIZERS}
    step_s: dict[str, list[float]] = {k: [] for k in OPTIMIZERS}
    opt_s: dict[str, list[float]] = {k: [] for k in OPTIMIZERS}
    for r in range(args.rounds):
        for name in OPTIMIZERS if r % 2 == 0 else OPTIMIZERS[::-1]:
            lo, st, op = train(name, args.flavor, args.steps, args.seq_len, args.micro_batch)
            losses[name].append(lo)
            step_s[name] += st[1:]
            opt_s[name] += op[1:]
            print(f"round {r + 1} {name}: final loss {lo[-1]:.4f}, median step {statistics.median(st[1:]) * 1000:.0f} ms", file=sys.stderr)
    marks = sorted({1, args.steps // 2, args.steps})
    rows = []
    for name in OPTIMIZERS:
        first = losses[name][0]
        same = all(run == first for run in losses[name])
        row: list = [name] + [round(first[s - 1], 4) for s in marks]
        row += [
            "yes" if same else "no",
            round(statistics.median(step_s[name]) * 1000, 1),
            f"{min(step_s[name]) * 1000:.0f}-{max(step_s[name]) * 1000:.0f}",
            round(statistics.median(opt_s[name]) * 1000, 1),
        ]
        rows.append(row)
    body = table(
        ["optimizer"] + [f"loss at step {s}" for s in marks] + ["same losses every round", "median step ms", "step range (ms)", "median optimizer.step() ms"],
        rows,
    )
    tokens = args.steps * args.micro_batch * args.seq_len
    body += (
        f"\n\nllama3 `{args.flavor}` (fp32), {args.steps} steps of {args.micro_batch} x {args.seq_len} tokens ({tokens:,} tokens per run) "
        f"of the Shakespeare corpus, the same batches for both; grad clip 1.0, constant LR at each plugin's defaults "
        f"(adamw: lr 3e-4, wd 0.1; muon: lr 0.02, adjust_lr original, wd 0 on the hidden matrices, AdamW lr 3e-4 on the rest); "
        f"one process, torch's default threads ({torch.get_num_threads()}); {args.rounds} alternating rounds; step times exclude "
        f"the first step of every run."
    )
    print(body)
    if not args.no_record:
        report(f"Muon against AdamW: {args.flavor} on cpu", body, "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
