"""``plait mup-check --config F --widths 64,128,256 [--steps 3] [--scale ffn_dim=3] [--png F] [--json]``

µP's coordinate check (Yang et al. 2022, "Tensor Programs V", section D): the config's model at
each width (``[model].dim``, or ``--width-key``; ``--scale key=r`` sets another option to r x width,
e.g. ``ffn_dim=3``), under standard parametrization and under µP with the first width as the base,
trained ``--steps`` steps with the config's optimizer at its peak LR (no schedule, no clipping) on
the config's data, on this machine's first device, one process. For each layer (each embedding,
each of the model's ``blocks()``, the logits) it measures on one fixed batch the RMS of the
activations after the steps and the RMS of their change since init (what the updates did), and
fits the slope of log RMS against log width. Under µP the slopes are near 0 (flat); under standard
parametrization the change grows with width (slope near 1 for the logits with AdamW).

Prints one table per parametrization (``--json``: the numbers); ``--png`` also plots them
(matplotlib, when installed; else a warning). A model that declares no widths is checked under
standard parametrization only. Bad input is one line, exit 2.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import torch
from torch import nn

from core.contract import log
from core.contract.errors import ArgumentParser, ConfigError, PlaitError, exit_bad_input
from core.contract.protocols import LoaderSpec
from core.loop.assemble import make_optimizer
from core.preflight.prepare import prepare
from core.runtime.materialize import materialize

QUANTITIES = ("activation", "change")


def rms(t: torch.Tensor) -> float:
    return float(t.detach().float().pow(2).mean().sqrt())


def slope(widths: list[int], values: list[float]) -> float:
    """Least-squares slope of log value against log width (0.0 for a value that is 0 everywhere)."""
    xs = [math.log(w) for w in widths]
    ys = [math.log(max(v, 1e-30)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def layer_outputs(spec: Any, model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each embedding's and each block's output and the logits, for a forward of ``ids``."""
    named = [(f"embedding.{n}" if n else "embedding", m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    named += [(f"block.{i}", b) for i, b in enumerate(spec.blocks(model))]
    out: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(_m: nn.Module, _args: Any, y: Any) -> None:
            out[name] = (y[0] if isinstance(y, tuple) else y).detach().clone()

        return hook

    handles = [m.register_forward_hook(keep(name)) for name, m in named]
    try:
        with torch.no_grad():
            out["logits"] = model(ids).detach().clone()
    finally:
        for h in handles:
            h.remove()
    return out


def measure_width(config: str, overrides: list[str], steps: int) -> dict[str, dict[str, float]]:
    """``{layer: {"activation": rms, "change": rms}}`` after ``steps`` steps of the config with ``overrides``."""
    prep = prepare(config, overrides, validate_data=False)
    rc, c = prep.rc, prep.components
    spec, device = c["model"], prep.device
    torch.manual_seed(rc.train.seed)
    with torch.device("meta"):
        model = spec.build()
    materialize(model, device)
    with torch.no_grad():
        spec.init_weights(model)
    optimizer = make_optimizer(spec, rc.slots["model"].component.name, model, c["optimizer"])
    micro = int(rc.train.micro_batch)
    loader = c["data"].loader(LoaderSpec(rc.seq_len, micro, 1, 0, 1, rc.train.seed, vocab_size=spec.vocab_size))
    batches = iter(loader)
    probe_ids, _ = next(iter(c["data"].loader(LoaderSpec(rc.seq_len, micro, 1, 0, 1, rc.train.seed + 1, vocab_size=spec.vocab_size))))
    probe_ids = probe_ids.to(device)
    before = layer_outputs(spec, model, probe_ids)
    for _ in range(steps):
        ids, labels = next(batches)
        loss = model(ids.to(device), labels.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    after = layer_outputs(spec, model, probe_ids)
    return {name: {"activation": rms(after[name]), "change": rms(after[name] - before[name])} for name in after}


def coordinates(config: str, overrides: list[str], widths: list[int], steps: int, width_key: str, scale: dict[str, float], mup: bool) -> dict[str, Any]:
    """``{"widths", "layers": {layer: {quantity: [rms per width]}}, "slopes": {layer: {quantity: slope}}}``."""
    layers: dict[str, dict[str, list[float]]] = {}
    for w in widths:
        shape = [f"--model.{width_key}={w}", *(f"--model.{k}={round(r * w)}" for k, r in scale.items())]
        asked = ["--model.parametrization=mup", f"--model.mup_base_width={widths[0]}"] if mup else []
        for name, values in measure_width(config, [*overrides, *shape, *asked], steps).items():
            for q in QUANTITIES:
                layers.setdefault(name, {k: [] for k in QUANTITIES})[q].append(values[q])
    slopes = {name: {q: slope(widths, v[q]) for q in QUANTITIES} for name, v in layers.items()}
    return {"widths": widths, "layers": layers, "slopes": slopes}


def table(title: str, result: dict[str, Any]) -> str:
    widths = result["widths"]
    head = f"{'layer':<12} {'quantity':<10} " + " ".join(f"{'w=' + str(w):>10}" for w in widths) + f" {'slope':>7}"
    lines = [title, head]
    for name, values in result["layers"].items():
        for q in QUANTITIES:
            lines.append(f"{name:<12} {q:<10} " + " ".join(f"{v:>10.4g}" for v in values[q]) + f" {result['slopes'][name][q]:>7.2f}")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        log.warn(f"--png {path}: matplotlib is not importable ({e}); no plot written")
        return
    fig, axes = plt.subplots(len(QUANTITIES), len(results), figsize=(5 * len(results), 7), squeeze=False)
    for col, (title, result) in enumerate(results.items()):
        for row, q in enumerate(QUANTITIES):
            ax = axes[row][col]
            for name, values in result["layers"].items():
                ax.plot(result["widths"], values[q], marker="o", label=name)
            ax.set(xscale="log", yscale="log", xlabel="width", ylabel=f"RMS of the {q}", title=f"{title}: {q}")
    axes[0][-1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    log.info(f"coordinate check plotted to {path}")


def parse_scale(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, _, ratio = item.partition("=")
        try:
            out[key] = float(ratio)
        except ValueError:
            raise ConfigError(f"--scale {item!r}: expected key=ratio, e.g. ffn_dim=3") from None
    return out


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="plait mup-check", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--config", required=True)
    p.add_argument("--widths", required=True, help="comma-separated widths, smallest first (the first is µP's base width)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps at each width (default 3)")
    p.add_argument("--width-key", default="dim", help="the [model] option that sets the width (default dim)")
    p.add_argument("--scale", action="append", default=[], help="key=r: set [model].key to r x width (repeatable), e.g. ffn_dim=3")
    p.add_argument("--png", default="", help="also plot the RMS against width here (matplotlib)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args, overrides = p.parse_known_args(argv)
    try:
        try:
            widths = [int(w) for w in args.widths.split(",")]
        except ValueError:
            raise ConfigError(f"--widths {args.widths!r}: expected comma-separated ints, e.g. 64,128,256") from None
        if len(widths) < 2 or widths != sorted(set(widths)) or widths[0] < 1:
            raise ConfigError(f"--widths {args.widths!r}: expected two or more increasing widths, the first the base")
        if args.steps < 1:
            raise ConfigError(f"--steps {args.steps}: expected at least 1")
        scale = parse_scale(args.scale)
        results = {"standard": coordinates(args.config, overrides, widths, args.steps, args.width_key, scale, mup=False)}
        try:
            results["mup"] = coordinates(args.config, overrides, widths, args.steps, args.width_key, scale, mup=True)
        except ConfigError as e:
            if "parametrization" not in str(e):
                raise
            log.warn(f"µP not checked: {e}")
    except PlaitError as e:
        return exit_bad_input(e)
    if args.json:
        print(json.dumps(results))
    else:
        print("\n\n".join(table(f"{name} parametrization (RMS after {args.steps} steps; slope of log RMS on log width)", r) for name, r in results.items()))
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
