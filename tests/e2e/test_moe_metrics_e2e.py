"""The recurrent MoE's logged loss parts and health are the step's values over every rank and micro-batch
(2 real gloo processes), reduced by core.contract.metrics.reduce_parts in one collective."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, torchrun_script

sys.path.insert(0, str(REPO / "tests" / "workers"))
import moe_parts  # noqa: E402


def per_micro_batch(model, ids):
    """One micro-batch alone, as a fresh log step (the trainer's ``log_step``): the model's local view of it, and lm from logits."""
    model.log_step(True)
    with torch.enable_grad():
        model(ids, ids)
    local = model.extra_metrics()
    with torch.no_grad():
        logits = model(ids)
    lm = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids.reshape(-1))
    return local, float(lm)


def test_loss_parts_are_means_over_ranks_and_micro_batches(tmp_path):
    out = tmp_path / "got.json"
    proc = torchrun_script(2, REPO / "tests" / "workers" / "moe_parts.py", str(out), extra_env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())

    model = moe_parts.build()
    last = moe_parts.STEPS - 1
    views, lms = [], []
    for rank in range(2):
        for micro in range(moe_parts.MICRO):
            local, lm = per_micro_batch(model, moe_parts.batch(rank, last, micro))
            views.append(local)
            lms.append(lm)
    counts = torch.zeros(4, dtype=torch.int64)  # tokens per expert over both steps (the log window), both ranks
    for rank in range(2):
        for step in range(moe_parts.STEPS):
            for micro in range(moe_parts.MICRO):
                counts += torch.tensor(per_micro_batch(model, moe_parts.batch(rank, step, micro))[0]["moe/expert_tokens"])

    mean = lambda key: sum(v[key] for v in views) / len(views)  # noqa: E731
    assert got["lm"] == pytest.approx(sum(lms) / len(lms), rel=1e-5)
    for key in ("lm", "aux", "z", "moe/router_entropy"):
        assert got[key] == pytest.approx(mean(key), rel=1e-5), key
    for key in ("moe/loop_cos_min", "moe/expert_spread_min"):
        assert got[key] == pytest.approx(min(v[key] for v in views), rel=1e-5), key
    assert got["moe/expert_tokens"] == counts.tolist()
    assert got["moe/load_imbalance"] == pytest.approx(float(counts.max() / counts.float().mean()), rel=1e-6)
    # not rank 0's last micro-batch (the old behaviour), and the ranks' data really differ
    assert got["lm"] != pytest.approx(views[moe_parts.MICRO - 1]["lm"], rel=1e-6)
    assert views[0]["lm"] != pytest.approx(views[moe_parts.MICRO]["lm"], rel=1e-6)
