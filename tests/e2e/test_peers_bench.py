"""bench/peers.py stays runnable: plait and the bare loop, one round of two steps; bad input is one line.

The peer trainers are not installed in CI: nothing here imports them, and the
bench's own process never does either (each candidate runs in its own subprocess).
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.conftest import PY, run_module


def test_plait_and_bare_rows():
    proc = run_module("bench.peers", "--candidates", "plait,bare", "--rounds", "1", "--steps", "2", "--warmup", "1", "--no-record", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0] in ("plait", "bare"):
            rows[cells[0]] = cells
    assert set(rows) == {"plait", "bare"}, proc.stdout
    for cells in rows.values():
        assert cells[1] == "1", cells  # one process
        median, tokens = float(cells[2]), float(cells[4].replace(",", ""))
        assert median > 0 and tokens > 0, cells
        lo, hi = (float(x) for x in re.fullmatch(r"([\d.]+)-([\d.]+)", cells[3]).groups())
        assert 0 < lo <= median <= hi, cells


def test_uninstalled_peer_is_one_line_and_no_figure():
    missing = next(
        (c for c, mod in (("olmo-core", "olmo_core"), ("litgpt", "litgpt"), ("torchtitan", "torchtitan")) if importlib.util.find_spec(mod) is None), None
    )
    if missing is None:
        pytest.skip("every peer is installed in this environment")
    proc = run_module("bench.peers", "--candidates", f"plait,{missing}", "--peers-python", PY, "--no-record", timeout=120)
    assert proc.returncode != 0
    assert proc.stdout.strip() == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and missing in lines[0] and "not installed" in lines[0], proc.stderr


def test_cuda_without_cuda_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = run_module("bench.peers", "--candidates", "bare", "--device", "cuda", "--no-record", timeout=120)
    assert proc.returncode != 0 and proc.stdout.strip() == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0], proc.stderr
