"""One recurrent-MoE layer, sparse dispatch against dense, before and after the sparse path lost its fixed costs.

"before" is ``model_specs/recurrent_moe/model.py``'s ``MoE`` as it stood at ``--before`` (read from git: it
stacked the experts' weights and ran every expert on a 16-token probe on every forward); "after" is the
checkout's (stacked parameters, the probe once per training step: not in this forward + backward). The four
layers share weights, router and input; each timed step is one forward + backward of the layer alone. Rounds
alternate the order of the four, and the medians over rounds are compared. The ideal sparse / dense ratio is
``top_k / n_experts`` (the FFN work each token gets).

    python -m bench.moe_layer --dim 256 --ffn-dim 1024 --experts 8 --top-k 2 --tokens 1024 --rounds 7
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, report, table


def layer_at(commit: str):
    """The ``MoE`` class of ``model_specs/recurrent_moe/model.py`` at ``commit``, imported from a temporary file."""
    text = subprocess.run(["git", "show", f"{commit}:model_specs/recurrent_moe/model.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="plait-bench-")) / "moe_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("moe_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["moe_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.MoE


def step_seconds(layer, x, steps: int) -> float:
    layer(x)[0].sum().backward()  # warm
    t0 = time.perf_counter()
    for _ in range(steps):
        layer.zero_grad(set_to_none=True)
        y, aux, z = layer(x)
        (y.square().mean() + aux + z).backward()
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn-dim", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--before", default="38ebb3e", help="the commit whose MoE layer is 'before'")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a shared machine)")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    import torch

    from model_specs.recurrent_moe.model import MoE

    torch.set_num_threads(args.threads)
    Before = layer_at(args.before)
    torch.manual_seed(0)
    shape = (args.dim, args.ffn_dim, args.experts, args.top_k)
    layers = {("after", "dense"): MoE(*shape, dispatch="dense"), ("after", "sparse"): MoE(*shape)}
    layers[("before", "dense")], layers[("before", "sparse")] = Before(*shape, dispatch="dense"), Before(*shape)
    ref = layers[("before", "dense")].state_dict()  # one set of weights: the old per-expert layout loads into the stacked one
    for layer in layers.values():
        layer.load_state_dict(ref)
    x = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the four compute one function
        want = layers[("before", "dense")](x)[0]
        for key, layer in layers.items():
            torch.testing.assert_close(layer(x)[0], want, rtol=1e-4, atol=1e-5, msg=f"{key} differs from the dense layer")
    times: dict[tuple[str, str], list[float]] = {k: [] for k in layers}
    keys = list(layers)
    for r in range(args.rounds):
        for key in keys if r % 2 == 0 else keys[::-1]:
            times[key].append(step_seconds(layers[key], x, args.steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for when in ("before", "after"):
        for mode in ("dense", "sparse"):
            k = (when, mode)
            ratio = f"{med[k] / med[(when, 'dense')]:.2f}"
            rows.append([f"{when}, {mode}", f"{med[k] * 1e3:.1f}", ratio, ", ".join(f"{t * 1e3:.0f}" for t in times[k])])
    body = table(["layer", "median ms (fwd + bwd)", "/ dense", "rounds (ms)"], rows)
    # each round's sparse / dense of the same code, timed back to back: steadier than a ratio of medians under load
    per_round = {w: statistics.median(s / d for s, d in zip(times[(w, "sparse")], times[(w, "dense")])) for w in ("before", "after")}
    body += (
        f"\n\nsparse / dense, median of the rounds' ratios: before {per_round['before']:.2f}, after {per_round['after']:.2f}; "
        f"ratio of medians: before {med[('before', 'sparse')] / med[('before', 'dense')]:.2f}, after {med[('after', 'sparse')] / med[('after', 'dense')]:.2f} "
        f"(ideal {args.top_k / args.experts:.2f}). One MoE layer, dim {args.dim}, ffn_dim {args.ffn_dim}, {args.experts} experts, top-{args.top_k}, "
        f"{args.tokens} tokens, float32, eager, {args.steps} steps per round, {args.rounds} alternating rounds, {torch.get_num_threads()} thread(s), "
        f"'before' = {args.before}; shared machine, load average {os.getloadavg()[0]:.1f} at the end."
    )
    print(body)
    if not args.no_record:
        report("Recurrent MoE layer: sparse vs dense, before and after the fixed costs", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
