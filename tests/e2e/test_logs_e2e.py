"""End to end through core.train: the guide's console line with the epoch, the MoE parts reduced over
2 gloo ranks, and fp8 forward/backward scales in metrics.jsonl. These need the trainer to call
core.contract.metrics.epoch, core.contract.metrics.model_metrics and core.contract.protocols.precision_log_step (see the
feature's notes)."""

from __future__ import annotations

import math
import re

from conftest import read_metrics, run_module, torchrun, write_tiny_config


def test_moe_console_line_with_epoch_on_two_ranks(tmp_path):
    proc = torchrun(
        2,
        "--config",
        "train_configs/recurrent_moe_debug.toml",
        f"--train.output_dir={tmp_path / 'out'}",
        "--train.steps=4",
        "--train.global_batch_tokens=2048",
        "--train.micro_batch=2",
        "--train.log_every=2",
        "--data.seq_len=128",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "tok/s" in line]
    pattern = (
        r"Epoch 1 \| step +\d+/4 \| loss \d+\.\d{4} \| lm \d+\.\d{4} \| aux \d+\.\d{4} \| z \d+\.\d{4} \| "
        r"gnorm \d+\.\d{2} \| lr \d\.\d{2}e[-+]\d{2} \| \d+\.\d{2}M tok/s \| \d+\.\d{2}B tokens"
    )
    assert len(lines) == 2 and all(re.fullmatch(pattern, line) for line in lines), lines
    rows = read_metrics(tmp_path / "out")
    assert rows[-1]["epoch"] > rows[0]["epoch"] > 0
    assert all(abs(r["loss"] - (r["lm"] + 0.01 * r["aux"] + 0.001 * r["z"])) < 1e-4 for r in rows)  # the step's parts


def test_fp8_scales_in_the_metrics(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=4)
    proc = run_module("core.train", "--config", str(cfg), "--train.log_every=2", "--precision.name=fp8", "--precision.allow_cpu=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        for key in ("fp8/fwd_amax", "fp8/fwd_scale", "fp8/bwd_amax", "fp8/bwd_scale"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert abs(r["fp8/fwd_scale"] - 448.0 / r["fp8/fwd_amax"]) < 1e-3 * r["fp8/fwd_scale"]
