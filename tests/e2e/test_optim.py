"""Optimizer plugins over real training: low-bit AdamW tracks AdamW over 30 steps, an adamw8bit checkpoint
resumes with new settings and with AdamW, an unknown option is refused, the LR plot is written, and the
automatic micro-batch keeps the global batch."""

from __future__ import annotations

import pytest
from conftest import read_metrics, run_module


@pytest.mark.slow
def test_an_adamw8bit_checkpoint_resumes_with_new_settings_and_with_adamw(tmp_path):
    """One adamw8bit leg (torchao compiles its step: the slow part), resumed twice from copies:
    with a new peak LR (torchao keeps the LR in a tensor: the line shows it rounded, the update uses
    it), and with plain AdamW (its state is not loaded, said once). The model's matrices are those of
    ``test_lowbit_adamw_tracks_adamw`` (64 x 64 and 512 x 64), so torchao's compiled
    steps are the same graphs; new betas (a recompile) are the unit test
    ``test_new_betas_apply_to_a_torchao_optimizer_after_its_load_and_are_named``."""
    import shutil

    from conftest import write_tiny_config

    cfg = write_tiny_config(tmp_path, body="[checkpoint]\nevery = 2\n")
    first = tmp_path / "first"
    args = ("core.train", "--config", str(cfg), "--model.n_kv_heads=4", "--model.ffn_dim=64")
    proc = run_module(*args, f"--train.output_dir={first}", "--optimizer.name=adamw8bit", "--train.steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]  # torchao's states trip no library warning into the log

    settings, other = tmp_path / "settings", tmp_path / "adamw"
    shutil.copytree(first, settings)
    shutil.copytree(first, other)
    proc = run_module(*args, f"--train.output_dir={settings}", "--optimizer.name=adamw8bit", "--train.steps=6", "--optimizer.lr=0.01")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "differ from this run's, which apply from the next step: peak lr 0.0003 -> 0.01" in proc.stderr
    rows = [r for r in read_metrics(settings) if r["step"] == 5]
    assert rows and rows[-1]["lr"] > 1e-3  # the new peak times the schedule, not the checkpoint's 3e-4 peak

    proc = run_module(*args, f"--train.output_dir={other}", "--optimizer.name=adamw", "--train.steps=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("holds optimizer state of 'adamw8bit', this run uses 'adamw'") == 1
    assert "at step 4" in proc.stdout
    assert [r["step"] for r in read_metrics(other)] == [1, 2, 3, 4, 5, 6]


def test_unknown_optimizer_option(tiny_config):
    proc = run_module("core.train", "--config", str(tiny_config()), "--optimizer.name=adamw8bit", "--optimizer.momentum=0.9")
    assert proc.returncode == 2 and "unknown key 'momentum'" in proc.stderr


def test_plot_lr_writes_png(tmp_path):
    out = tmp_path / "lr.png"
    proc = run_module(
        "core.plan",
        "--config",
        "train_configs/debug_cpu.toml",
        "--plot-lr",
        str(out),
        "--lr_schedule.name=wsd",
        "--lr_schedule.warmup_steps=0",
        "--lr_schedule.min_lr_ratio=0.0",
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_auto_micro_batch_on_cpu_keeps_global_batch(tiny_config, tmp_path):
    from core.config import files as config

    cfg = tiny_config(steps=1, global_batch_tokens=3072)  # 24 sequences of 128
    proc = run_module("core.train", "--config", str(cfg), '--train.micro_batch="auto"', "--train.micro_batch_max=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'micro_batch = "auto" chose 8 (accumulation 3)' in proc.stdout
    resolved = config.tomllib.loads((tmp_path / "out" / "config.resolved.toml").read_text())
    assert resolved["train"]["micro_batch"] == 8 and resolved["derived"]["grad_accum"] == 3


def train_debug(name: str, steps: int = 30) -> list[float]:
    """30 steps of the debug llama on the shipped corpus, in this process, with optimizer plugin
    ``name`` built through the registry (real options, real parameter groups). Shapes are chosen so
    every matrix is 64 x 64 or 512 x 64: a torchao low-bit optimizer compiles its step only a few times."""
    import numpy as np
    import torch
    from conftest import REPO
    from shared import build_optimizer

    from model_specs.llama3.spec import Llama3Spec
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    torch.manual_seed(0)
    spec = Llama3Spec.from_flavor("debug", dim=64, n_kv_heads=4, ffn_dim=64)
    model = spec.build()
    spec.init_weights(model)
    data = TokenBin(TokenBinOptions(path=str(REPO / "plugins" / "data" / "corpus" / "shakespeare")))
    optimizer = build_optimizer(name, {"lr": 3e-3}, model)
    losses = []
    for step in range(steps):
        rows = torch.from_numpy(np.stack([data.sample(step * 8 + j, 64, "train") for j in range(8)]))
        loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def adamw_reference():
    return train_debug("adamw")


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # the trainer's thread count: inductor's cache can serve the e2e adamw8bit test the graphs it shares
@pytest.mark.parametrize(
    "name",
    ["adamw8bit", pytest.param("adamw4bit", marks=pytest.mark.bench), "adamw_fp8", "bnb_adamw8bit"],  # 4-bit: the longest compile; `pytest -m bench`
)
def test_lowbit_adamw_tracks_adamw(adamw_reference, name):
    if name == "bnb_adamw8bit":
        pytest.importorskip("bitsandbytes", reason="bitsandbytes is the optional extra 'bitsandbytes' (in 'dev')")
    got = train_debug(name)
    ref = adamw_reference
    assert got[-1] < 0.5 * got[0]  # it optimizes
    # stated tolerance: final loss within 0.15 nats of AdamW's after 30 steps for the 8-bit states,
    # 0.3 for 4-bit (its coarser state lags early: 3.30 vs 3.08 here); not identical (really low-bit)
    tolerance = 0.3 if name == "adamw4bit" else 0.15
    assert abs(got[-1] - ref[-1]) < tolerance, (got[-1], ref[-1])
    assert got != ref
