"""µP's learning-rate transfer, shown: AdamW learning-rate sweeps at several widths, standard
parametrization against µP (``[model] parametrization = "mup"``, base width the smallest).

The llama3 ``debug`` shape (2 layers, 4 heads, ffn_dim 3 x dim, vocab 512) at each ``--widths`` dim,
fp32 on CPU in one process, trains ``--steps`` steps from the same seed on the same batches of the
shipped Shakespeare corpus (``--micro-batch`` rows of ``--seq-len`` tokens, one micro-batch per
step, gradient norm clipped to 1.0, constant LR) with the ``adamw`` plugin at each LR of
``--lrs``, over the core's parameter groups (µP's multipliers included: core.loop.assemble.make_optimizer).
Reported: the validation loss (the mean over ``--val-batches`` fixed micro-batches of the
validation split) at each width and LR, the best LR per width, and how far (in grid steps) the best
LR moves between the smallest and the largest width. ``--seeds`` repeats with other seeds (init and
batch order); the table holds their mean, and the noise is their spread.

    python -m bench.mup_transfer --widths 32,64,128,256 --steps 150
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from bench.common import REPO, report, table


def val_loss(
    parametrization: str, width: int, base: int, lr: float, steps: int, seq_len: int, micro_batch: int, val_batches: int, seed: int, optimizer: str
) -> float:
    import numpy as np
    import torch

    from core.config import registry
    from core.contract.option_values import build_options
    from core.loop.assemble import make_optimizer
    from model_specs.llama3.spec import Llama3Spec
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    torch.manual_seed(seed)
    spec = Llama3Spec.from_flavor("debug", dim=width, ffn_dim=3 * width, parametrization=parametrization, mup_base_width=base)
    model = spec.build()
    spec.init_weights(model)
    data = TokenBin(TokenBinOptions(path=str(REPO / "plugins" / "data" / "corpus" / "shakespeare")))
    component = registry.load().get("optimizer", optimizer, "bench")
    builder = component.factory(build_options(component.options, {"lr": lr, "adamw_lr": lr} if optimizer == "muon" else {"lr": lr}, "[optimizer]"))
    opt = make_optimizer(spec, "llama3", model, builder)
    order = np.random.default_rng(seed).permutation(10**6)

    def rows(indices, split):
        return torch.from_numpy(np.stack([data.sample(int(i), seq_len, split) for i in indices]).astype(np.int64))

    for step in range(steps):
        x = rows(order[step * micro_batch : (step + 1) * micro_batch], "train")
        loss = model(x[:, :-1], x[:, 1:])
        if not torch.isfinite(loss):
            return math.inf
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        losses = [model(v[:, :-1], v[:, 1:]).item() for v in (rows(range(b * micro_batch, (b + 1) * micro_batch), "val") for b in range(val_batches))]
    mean = sum(losses) / len(losses)
    return mean if math.isfinite(mean) else math.inf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--widths", default="32,64,128,256")
    p.add_argument("--lrs", default="0.0005,0.001,0.002,0.004,0.008,0.016", help="the LR grid, each a factor of 2 above the last")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--val-batches", type=int, default=4)
    p.add_argument("--seeds", default="0")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"))
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    widths, lrs, seeds = [int(w) for w in a.widths.split(",")], [float(x) for x in a.lrs.split(",")], [int(s) for s in a.seeds.split(",")]
    body = []
    moves = {}
    for param in ("standard", "mup"):
        rows, best = [], {}
        spread = 0.0
        for w in widths:
            per_seed = [[val_loss(param, w, widths[0], lr, a.steps, a.seq_len, a.micro_batch, a.val_batches, s, a.optimizer) for s in seeds] for lr in lrs]
            means = [statistics.mean(v) for v in per_seed]
            spread = max([spread] + [max(v) - min(v) for v in per_seed if all(math.isfinite(x) for x in v)])
            best[w] = min(range(len(lrs)), key=lambda i: means[i])
            rows.append([w, *[round(m, 4) if math.isfinite(m) else "diverged" for m in means], lrs[best[w]]])
            print(param, w, means, file=sys.stderr, flush=True)
        moves[param] = abs(best[widths[-1]] - best[widths[0]])
        body.append(f"### {param} parametrization ({a.optimizer}): validation loss after {a.steps} steps, by width and LR\n")
        body.append(table(["width", *[f"lr {lr:g}" for lr in lrs], "best lr"], rows))
        body.append(
            f"\nbest LR moves {moves[param]} grid step(s) from width {widths[0]} to {widths[-1]}; "
            + (f"seeds {a.seeds}, largest spread between seeds {spread:.4f}\n" if len(seeds) > 1 else f"one seed ({a.seeds}): noise not measured\n")
        )
    text = "\n".join(body)
    print(text)
    report(f"mup transfer ({a.optimizer})", text + "\n" + table(["parametrization", "best LR moves (grid steps)"], [[k, v] for k, v in moves.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
