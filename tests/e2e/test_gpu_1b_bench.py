"""bench.gpu_1b and every other CUDA bench, run without a GPU, refuse in one line."""

from __future__ import annotations

import pytest

from tests.conftest import run_module


def test_without_cuda_it_refuses_in_one_line():
    r = run_module("bench.gpu_1b", "--no-record", extra_env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "no CUDA device" in r.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["bench.overhead_parts"],
        ["bench.cuda_profile"],
        ["bench.overhead", "--device", "cuda", "--no-record"],
        ["bench.checkpoint_stall", "--device", "cuda", "--no-record"],
        ["bench.guard_cost", "--device", "cuda", "--no-record"],
    ],
    ids=lambda a: a[0],
)
def test_every_cuda_bench_refuses_without_cuda_in_one_line(argv):
    r = run_module(*argv, extra_env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and argv[0] in lines[0] and "CUDA" in lines[0], lines
