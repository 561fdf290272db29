"""µP's learning-rate transfer, shown with its noise: learning-rate sweeps at several widths, standard
parametrization against µP (``[model] parametrization = "mup"``, base width the smallest), AdamW or Muon,
several seeds per point.

The llama3 ``debug`` shape (2 layers, 4 heads, ffn_dim 3 x dim, vocab 512) at each ``--widths`` dim,
fp32 on CPU in one process, trains ``--steps`` steps on the shipped Shakespeare corpus
(``--micro-batch`` rows of ``--seq-len`` tokens, one micro-batch per step, gradient norm clipped to
1.0, constant LR) with ``--optimizer`` at each LR of ``--lrs`` (Muon: its ``lr`` and ``adamw_lr`` both),
over the core's parameter groups (µP's multipliers included: core.loop.assemble.make_optimizer).

Seeds are paired: seed s sets the init (``torch.manual_seed(s)``) and the order of the training
batches (``numpy.random.default_rng(s)``), the same at every LR and under both parametrizations (and
the batch order the same at every width), so the LRs of a width are compared on the same init and
the same batches. Validation: the mean loss over ``--val-batches`` fixed micro-batches of the
validation split, the same for every run. µP at the base width is not run again: it is the
standard run, bitwise (tests/unit/model_specs/test_mup.py).

Reported per width and LR: the mean validation loss over ``--seeds`` and its standard deviation
between seeds; per width the best LR of the mean, the best LR of each seed (its uncertainty), and
by how much the better grid neighbour of the best is worse, paired by seed (mean ± std of the
differences: a margin several std above 0 resolves the best LR), and the fitted optimum (each
seed's parabola through its best LR and the two neighbours, in log LR: mean ± std over seeds); and
how far the best LR and the fitted optimum move across the widths, in grid steps. ``--png`` plots loss against LR, one line
per width, with the seeds' spread as error bars. ``--log`` keeps each run's loss (a JSON line),
and runs already in it are read back, not rerun.

    python -m bench.mup_transfer --optimizer adamw --png docs/img/mup_transfer_adamw.png
    python -m bench.mup_transfer --optimizer muon --lrs 0.01,0.02,0.04,0.08,0.16 --png docs/img/mup_transfer_muon.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from bench.common import REPO, report, table

PARAMETRIZATIONS = ("standard", "mup")


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


def vertex(losses: list[float]) -> float:
    """Where on the grid (in grid steps, fractional) the parabola through the lowest loss and its two
    neighbours is lowest; the lowest's own index at the grid's edge or next to a diverged run."""
    b = min(range(len(losses)), key=lambda i: losses[i])
    if not 0 < b < len(losses) - 1 or not all(math.isfinite(x) for x in losses[b - 1 : b + 2]):
        return float(b)
    left, mid, right = losses[b - 1 : b + 2]
    curvature = left - 2 * mid + right
    return b + (0.5 * (left - right) / curvature if curvature > 0 else 0.0)


class Sweep:
    """The losses of one sweep, ``loss[(parametrization, width, lr, seed)]``, and what they say."""

    def __init__(self, widths: list[int], lrs: list[float], seeds: list[int], loss: dict[tuple[str, int, float, int], float]):
        self.widths, self.lrs, self.seeds, self.loss = widths, lrs, seeds, loss

    def cell(self, param: str, width: int, lr: float) -> list[float]:
        return [self.loss[param, width, lr, s] for s in self.seeds]

    def mean_std(self, param: str, width: int, lr: float) -> tuple[float, float]:
        v = self.cell(param, width, lr)
        if not all(math.isfinite(x) for x in v):
            return math.inf, math.inf
        return statistics.mean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)

    def best(self, param: str, width: int) -> int:
        """The grid index of the LR with the lowest mean loss."""
        return min(range(len(self.lrs)), key=lambda i: self.mean_std(param, width, self.lrs[i])[0])

    def seed_best(self, param: str, width: int) -> list[int]:
        """The grid index of each seed's best LR."""
        return [min(range(len(self.lrs)), key=lambda i: self.loss[param, width, self.lrs[i], s]) for s in self.seeds]

    def fitted(self, param: str, width: int) -> tuple[float, float]:
        """The optimum in grid steps (0: the first LR), each seed's from the parabola through its best
        LR and that LR's two neighbours (the best itself at the grid's edge): (mean, std) over seeds."""
        where = [vertex([self.loss[param, width, lr, s] for lr in self.lrs]) for s in self.seeds]
        return statistics.mean(where), (statistics.stdev(where) if len(where) > 1 else 0.0)

    def margin(self, param: str, width: int) -> tuple[float, float, float]:
        """How much worse the better grid neighbour of the best LR is, paired by seed: (mean, std)
        of its loss minus the best's, and that neighbour's LR."""
        b = self.best(param, width)
        pairs = []
        for i in (b - 1, b + 1):
            if 0 <= i < len(self.lrs):
                d = [self.loss[param, width, self.lrs[i], s] - self.loss[param, width, self.lrs[b], s] for s in self.seeds]
                if all(math.isfinite(x) for x in d):
                    pairs.append((statistics.mean(d), statistics.stdev(d) if len(d) > 1 else 0.0, self.lrs[i]))
        return min(pairs) if pairs else (math.inf, math.inf, math.nan)

    def lr_at(self, position: float) -> float:
        """The LR at a fractional grid position (a factor-2 grid: geometric between grid points)."""
        return self.lrs[0] * (self.lrs[1] / self.lrs[0]) ** position if len(self.lrs) > 1 else self.lrs[0]

    def moves(self, param: str) -> int:
        """Grid steps between the lowest and the highest best LR (of the mean) over all widths."""
        b = [self.best(param, w) for w in self.widths]
        return max(b) - min(b)

    def text(self, optimizer: str, steps: int) -> str:
        def lr_label(i: int) -> str:
            edge = " (edge)" if i in (0, len(self.lrs) - 1) else ""
            return f"{self.lrs[i]:g}{edge}"

        body = []
        for param in PARAMETRIZATIONS:
            rows = []
            for w in self.widths:
                cells = []
                for lr in self.lrs:
                    m, sd = self.mean_std(param, w, lr)
                    cells.append(f"{m:.3f} (± {sd:.3f})" if math.isfinite(m) else "diverged")
                b, per_seed = self.best(param, w), self.seed_best(param, w)
                dm, dsd, nb = self.margin(param, w)
                margin = f"{dm:.3f} (± {dsd:.3f}, vs {nb:g})" if math.isfinite(dm) else "-"
                at, at_sd = self.fitted(param, w)
                fit = f"{self.lr_at(at):.2g} (± {at_sd:.2f} grid steps)"
                rows.append([w, *cells, lr_label(b), ", ".join(f"{self.lrs[i]:g}" for i in per_seed), margin, fit])
            body.append(
                f"### {param} parametrization ({optimizer}): validation loss after {steps} steps, mean ± std over seeds {','.join(map(str, self.seeds))}\n"
            )
            body.append(
                table(["width", *[f"lr {lr:g}" for lr in self.lrs], "best lr (mean)", "best lr per seed", "next-best margin (paired)", "fitted optimum"], rows)
            )
            seed_moves = [max(b) - min(b) for b in zip(*(self.seed_best(param, w) for w in self.widths))]
            fits = [self.fitted(param, w)[0] for w in self.widths]
            body.append(
                f"\n{param}: the best LR (of the mean) moves {self.moves(param)} grid step(s) over widths "
                f"{self.widths[0]}-{self.widths[-1]}; per seed {', '.join(map(str, seed_moves))}; the fitted optimum "
                f"spans {max(fits) - min(fits):.2f} grid steps, {fits[-1] - fits[0]:+.2f} from width {self.widths[0]} to {self.widths[-1]}\n"
            )
        return "\n".join(body)

    def summary(self) -> list[list]:
        return [
            [param, ", ".join(f"{self.lrs[self.best(param, w)]:g}" for w in self.widths), self.moves(param), "yes" if self.moves(param) <= 1 else "no"]
            for param in PARAMETRIZATIONS
        ]

    def plot(self, path: Path, optimizer: str, steps: int) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        finite = [self.mean_std(p, w, lr)[0] for p in PARAMETRIZATIONS for w in self.widths for lr in self.lrs]
        low = min(x for x in finite if math.isfinite(x))
        for ax, param in zip(axes, PARAMETRIZATIONS):
            for w in self.widths:
                pts = [(lr, *self.mean_std(param, w, lr)) for lr in self.lrs]
                pts = [p for p in pts if math.isfinite(p[1])]
                line = ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", ms=3, capsize=3, label=f"width {w}")
                b = self.lrs[self.best(param, w)]
                ax.plot([b], [self.mean_std(param, w, b)[0]], "*", ms=13, color=line[0].get_color())
            ax.set_xscale("log", base=2)
            ax.set_xticks(self.lrs, [f"{lr:g}" for lr in self.lrs])
            ax.minorticks_off()
            ax.set_xlabel("learning rate")
            ax.set_title(f"{'µP (base width ' + str(self.widths[0]) + ')' if param == 'mup' else 'standard'}, {optimizer}")
            ax.set_ylim(low - 0.05, low + 0.6)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel(f"validation loss after {steps} steps")
        axes[1].legend()
        fig.suptitle(f"llama3 debug shape, Shakespeare: mean ± std over {len(self.seeds)} seeds; ★ best LR")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--widths", default="16,32,64,128")
    p.add_argument("--lrs", default="0.002,0.004,0.008,0.016,0.032,0.064", help="the LR grid, each a factor of 2 above the last")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"))
    p.add_argument("--png", default="", help="plot loss against LR to this file (matplotlib)")
    p.add_argument("--log", default="", help="JSON lines of each run's loss; runs already there are read back")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    widths, lrs, seeds = [int(w) for w in a.widths.split(",")], [float(x) for x in a.lrs.split(",")], [int(s) for s in a.seeds.split(",")]
    setup = {"optimizer": a.optimizer, "steps": a.steps, "seq_len": a.seq_len, "micro_batch": a.micro_batch, "val_batches": a.val_batches, "base": widths[0]}
    loss: dict[tuple[str, int, float, int], float] = {}
    log = Path(a.log) if a.log else None
    if log and log.exists():
        for line in log.read_text().splitlines():
            r = json.loads(line)
            if all(r.get(k) == v for k, v in setup.items()):
                loss[r["parametrization"], r["width"], r["lr"], r["seed"]] = r["loss"]
    # Seeds outermost: a sweep cut short still has every cell of its first seeds.
    for s in seeds:
        for w in widths:
            for param in PARAMETRIZATIONS:
                for lr in lrs:
                    key = (param, w, lr, s)
                    if param == "mup" and w == widths[0]:  # µP at its base width is the standard run, bitwise (tests/unit/model_specs/test_mup.py)
                        loss[key] = loss["standard", w, lr, s]
                    elif key not in loss:
                        loss[key] = val_loss(param, w, widths[0], lr, a.steps, a.seq_len, a.micro_batch, a.val_batches, s, a.optimizer)
                        if log:
                            with log.open("a") as f:
                                f.write(json.dumps({**setup, "parametrization": param, "width": w, "lr": lr, "seed": s, "loss": loss[key]}) + "\n")
                    print(param, w, lr, s, loss[key], file=sys.stderr, flush=True)
    sweep = Sweep(widths, lrs, seeds, loss)
    text = sweep.text(a.optimizer, a.steps)
    print(text)
    if a.png:
        sweep.plot(Path(a.png), a.optimizer, a.steps)
    summary = table(["parametrization", "best LR by width", "best LR moves (grid steps)", "within one grid step"], sweep.summary())
    print(summary)
    report(f"mup transfer ({a.optimizer}, {len(seeds)} seeds)", text + "\n" + summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
