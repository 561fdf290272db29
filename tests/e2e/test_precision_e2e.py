"""Low precision on CPU over real runs: torchao fp8 recipes and emulated MXFP8 track bf16, and the
fallback chain skips unsupported plugins recording why, or takes the first supported with its options."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import read_metrics, run_module

# dims divisible by 32 so every block linear is eligible for fp8 and MXFP8
SMALL = (
    "--model.dim=64",
    "--model.ffn_dim=192",
    "--data.seq_len=64",
    "--train.global_batch_tokens=256",
    "--train.micro_batch=4",
    "--train.steps=30",
    "--optimizer.lr=3e-3",
    "--lr_schedule.warmup_steps=3",
    "--checkpoint.at_end=false",
)
TOLERANCE = 0.15  # final loss within 0.15 nats of bf16 after 30 steps


def final_loss(cfg, out, *extra):
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={out}", *SMALL, *extra, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert len(rows) == 30
    return rows


@pytest.fixture(scope="module")
def bf16_rows(tmp_path_factory, request):
    from conftest import REPO

    tmp = tmp_path_factory.mktemp("bf16")
    cfg = tmp / "run.toml"
    cfg.write_text(
        f'extends = "{REPO / "train_configs" / "debug_cpu.toml"}"\n[monitors]\nenabled = ["jsonl"]\n[train]\nlog_every = 1\n'
        f'[data]\npath = "{REPO / "plugins" / "data" / "corpus" / "shakespeare"}"\n'
    )
    rows = final_loss(cfg, tmp / "out", "--precision.name=bf16")
    return cfg, rows


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ("--precision.name=fp8", "--precision.recipe=tensorwise", "--precision.allow_cpu=true"),
        ("--precision.name=fp8", "--precision.recipe=rowwise", "--precision.allow_cpu=true"),
        ("--precision.name=fp8", "--precision.recipe=rowwise_with_gw_hp", "--precision.allow_cpu=true"),
        ("--precision.name=mxfp8", "--precision.emulate=true"),
    ],
    ids=["fp8-tensorwise", "fp8-rowwise", "fp8-rowwise_with_gw_hp", "mxfp8-emulated"],
)
def test_low_precision_tracks_bf16(bf16_rows, tmp_path, extra):
    cfg, ref = bf16_rows
    rows = final_loss(cfg, tmp_path / "out", *extra)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0  # it learns
    assert abs(rows[-1]["loss"] - ref[-1]["loss"]) < TOLERANCE, (rows[-1]["loss"], ref[-1]["loss"])
    health = [k for k in rows[-1] if k.startswith(("fp8/", "mxfp8/"))]
    assert health, rows[-1]  # scale/amax statistics are logged


def test_fallback_chain_skips_unsupported_and_records_reasons(tiny_config, tmp_path):
    from core.config import files as config

    cfg = tiny_config(steps=1)
    proc = run_module("core.train", "--config", str(cfg), '--precision.fallback=["te_fp8", "mxfp8", "fp8", "bf16"]')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "precision fallback chose 'bf16'" in proc.stderr
    resolved = config.tomllib.loads((tmp_path / "out" / "config.resolved.toml").read_text())
    p = resolved["precision"]
    assert p["name"] == "bf16" and p["fallback"] == ["te_fp8", "mxfp8", "fp8", "bf16"]
    if importlib.util.find_spec("transformer_engine") is None:
        assert "transformer_engine is not installed" in p["fallback_reasons"]["te_fp8"]
    assert "no CUDA device" in p["fallback_reasons"]["mxfp8"] and "no CUDA device" in p["fallback_reasons"]["fp8"]


def test_fallback_chain_takes_first_supported_with_options(tiny_config, tmp_path):
    """A plugin made supported by its own option ([precision.fp8] allow_cpu) is picked before bf16."""
    from core.config import files as config

    cfg = tiny_config(steps=1, body='[precision]\nfallback = ["te_fp8", "fp8", "bf16"]\n[precision.fp8]\nallow_cpu = true\n')
    text = cfg.read_text().replace('[precision]\nname = "fp32"\n', "")
    cfg.write_text(text)
    proc = run_module("core.train", "--config", str(cfg), "--model.ffn_dim=192")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = config.tomllib.loads((tmp_path / "out" / "config.resolved.toml").read_text())
    assert resolved["precision"]["name"] == "fp8" and list(resolved["precision"]["fallback_reasons"]) == ["te_fp8"]
