"""core.checkpoint.replicas: each rank's share of a replicated state (what an async save copies)."""

from __future__ import annotations

import torch
from shared import nbytes

from core.checkpoint.replicas import fingerprint, owners, share


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    sizes = [int(s) for s in torch.randint(1, 400, (23,), generator=g)]
    model = {f"layers.{i}.w": torch.zeros(n) for i, n in enumerate(sizes)}
    optim = {
        "state": {name: {"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t), "step": torch.tensor(3.0)} for name, t in model.items()},
        "param_groups": [{"lr": 0.1, "params": list(model)}],
    }
    return {"model": model, "optimizer": optim}


def paths(x, at=()) -> set:
    if isinstance(x, dict):
        return {p for k, v in x.items() for p in paths(v, (*at, k))}
    return {at} if isinstance(x, torch.Tensor) else set()


def test_the_shares_split_every_tensor_once_and_balance_the_bytes():
    full = state()
    largest = max(t.numel() * t.element_size() for t in full["model"].values())
    for world in (1, 2, 3, 8):
        shares = [share(full, r, world) for r in range(world)]
        found = [paths(s) for s in shares]
        assert set().union(*found) == paths(full)
        assert sum(len(f) for f in found) == len(paths(full))  # no tensor written twice
        sizes = [nbytes(s) for s in shares]
        assert max(sizes) - min(sizes) <= largest, (world, sizes)
        for s in shares:  # what is not a tensor stays on every rank (DCP de-duplicates it)
            assert s["optimizer"]["param_groups"] == full["optimizer"]["param_groups"]


def test_every_rank_computes_the_same_owners_and_fingerprint_ignores_values():
    a, b = state(), state()
    b["model"]["layers.0.w"] += 1.0
    assert owners(a, 4) == owners(b, 4) and fingerprint(a) == fingerprint(b)
    b["model"]["layers.0.w"] = torch.zeros(5, dtype=torch.float16)
    assert fingerprint(a) != fingerprint(b)
