"""On a CUDA device: bf16 and fp8 training runs end to end through ``core.train`` (bf16 trains, compiled
matches eager, fp8 tracks bf16). These are the GPU checks CI (no GPU) cannot make; they run wherever
a CUDA device is present (``pytest tests/e2e/test_cuda.py`` on a GPU node)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import read_metrics, run_module, write_tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _train(tmp_path, name: str, *overrides: str) -> list[dict]:
    cfg = write_tiny_config(tmp_path, f"{name}.toml", steps=30)
    out = tmp_path / name
    r = run_module(
        "core.train",
        "--config",
        str(cfg),
        "--train.device=cuda",
        f"--train.output_dir={out}",
        "--model.dim=256",
        "--model.n_heads=4",
        "--model.n_kv_heads=2",
        "--optimizer.lr=3e-3",
        "--checkpoint.at_end=false",
        "--checkpoint.resume=none",
        *overrides,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return read_metrics(out)


@pytest.fixture(scope="module")
def bf16_rows(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("bf16"), "bf16", "--precision.name=bf16", '--monitors.enabled=["console", "jsonl", "mfu"]')


def test_bf16_trains_on_cuda(bf16_rows):
    losses = [r["loss"] for r in bf16_rows]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 1.0
    logged = [r for r in bf16_rows if "mfu" in r]
    assert logged, "the mfu monitor wrote no mfu"
    if "H100" in torch.cuda.get_device_name() or "H200" in torch.cuda.get_device_name():
        assert 0 < logged[-1]["mfu"] < 1, logged[-1]


def test_bf16_compiled_matches_eager(bf16_rows, tmp_path):
    rows = _train(tmp_path, "compiled", "--precision.name=bf16", "--train.compile=true")
    eager, compiled = bf16_rows[-1]["loss"], rows[-1]["loss"]
    assert abs(eager - compiled) < 0.1, (eager, compiled)


@pytest.mark.skipif(not HOPPER, reason="fp8 needs a CUDA device of compute capability 8.9 or newer (none visible)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_tracks_bf16_on_cuda(bf16_rows, tmp_path, recipe):
    # dim 256 is below torchao's size thresholds: without the filter off, every linear would stay in bf16
    rows = _train(tmp_path, recipe, "--precision.name=fp8", f"--precision.recipe={recipe}", "--precision.small_gemm_filter=false", "--train.compile=true")
    low, ref = rows[-1]["loss"], bf16_rows[-1]["loss"]
    assert abs(low - ref) < 0.15, (recipe, low, ref)
    logged = [r for r in rows if "fp8/linears" in r]
    assert logged and logged[-1]["fp8/linears"] > 0, "no linear was converted to float8"
