"""A µP run's checkpoints downstream, through the real trainer: a 2-rank fsdp2 µP run (gloo) saves,
and one process resumes it resharded with the losses the uninterrupted run had."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_module, torchrun, write_tiny_config
from shared import losses

pytestmark = pytest.mark.slow

# dim 128 against base width 64: r = 0.5, so the logits, attention scores, head init and the
# hidden matrices' LR all differ from standard parametrization; the debug head is untied (µP's own
# "output" group).
MUP = ("--model.dim=128", "--model.parametrization=mup", "--model.mup_base_width=64")


def test_mup_fsdp2_checkpoint_resumes_on_one_process_with_the_uninterrupted_losses(tmp_path: Path):
    """Tolerance: rel 2e-5 / abs 2e-5 (fp32 summation order differs between 2 fsdp2 ranks and one
    process; the same global samples every step), as for the standard resharded resume
    (tests/e2e/test_checkpoint.py). A resume that dropped µP's LR multipliers or its logit
    multiplier would change the loss of step 5 by far more."""
    cfg = write_tiny_config(tmp_path, steps=8, global_batch_tokens=1024)
    out = tmp_path / "run"
    common = ("--config", str(cfg), f"--train.output_dir={out}", *MUP)
    first = torchrun(2, *common, "--parallelism.name=fsdp2", "--checkpoint.every=4")
    assert first.returncode == 0, first.stderr[-3000:]
    straight = losses(out)  # the uninterrupted 8 steps (saving changes no arithmetic)
    assert sorted(straight) == list(range(1, 9))
    shutil.rmtree(out / "checkpoints" / "step_000000008")

    resumed = run_module("core.train", *common, "--parallelism.name=ddp")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step_000000004 at step 4" in resumed.stdout
    got = losses(out)
    for s in range(5, 9):
        assert got[s] == pytest.approx(straight[s], rel=2e-5, abs=2e-5), (s, got, straight)
    assert json.loads((out / "run_info.json").read_text())["world_size"] == 1
    saved = json.loads((out / "checkpoints" / "step_000000008" / "state.json").read_text())
    assert saved["config"]["model"]["parametrization"] == "mup" and saved["config"]["model"]["mup_base_width"] == 64
