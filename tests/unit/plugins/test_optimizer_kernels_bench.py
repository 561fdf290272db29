"""bench.optimizer_kernels: its table, and the one-line refusal of a device that is not there."""

from __future__ import annotations

import pytest


def test_three_kernels_measured_without_recording(capsys):
    from bench import optimizer_kernels
    from bench.results import RESULTS

    before = RESULTS.read_text()
    assert optimizer_kernels.main(["--flavor", "debug", "--steps", "1", "--rounds", "1", "--no-record"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "kernel" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["fused", "foreach", "for-loop"]
    assert float(rows[0].split("|")[4]) == 1.0  # fused against itself
    assert RESULTS.read_text() == before


def test_cuda_without_cuda_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal cannot happen here")
    from bench import optimizer_kernels

    assert optimizer_kernels.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench.optimizer_kernels: --device cuda asked, but torch sees no CUDA device"]
