"""A checkpoint moves between layouts with its data position (llama3, float32, gloo, CPU, real
processes): a run saved under dp 2 x tp 2 (fsdp2 with tp = 2 on 4 ranks) at step 3 resumes under
fsdp2 on 4 ranks, under pp 2 x dp 2 and on one process; each of those saves at step 4, and that
checkpoint resumes back under dp 2 x tp 2. Every resumed run continues the same sample stream with
the uninterrupted dp 2 x tp 2 run's losses and gradient norms (relative 1e-5: the same float32 math
summed in another order). ``core.export`` and ``core.generate`` read the pp 2 x dp 2 and the
dp 2 x tp 2 checkpoints as the one-process checkpoint of the same step: the same weights (1e-5), the
same greedy text."""

from __future__ import annotations

import pytest
import torch
from conftest import run_module
from safetensors.torch import load_file
from test_tensor_parallel import TOL, curve, train

pytestmark = pytest.mark.slow

DP2_TP2 = (4, ("--parallelism.name=fsdp2", "--parallelism.tp=2"))
LAYOUTS = {  # name -> (ranks, options)
    "fsdp4": (4, ("--parallelism.name=fsdp2",)),
    "pp2dp2": (4, ("--parallelism.name=fsdp2", "--parallelism.pp=2")),
    "one": (1, ("--parallelism.name=single",)),
}


def step(run, n):
    return run / "checkpoints" / f"step_{n:09d}"


def exported(tmp_path, ckpt, name):
    out = tmp_path / "exported" / name
    proc = run_module("core.export", "--checkpoint", str(ckpt), "--format", "safetensors", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(out / "model.safetensors")


def greedy(ckpt):
    proc = run_module("core.generate", "--checkpoint", str(ckpt), "--prompt", "ROMEO: What", "--max-new-tokens", "16", "--temperature", "0", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_dp_x_tp_checkpoint_resumes_under_fsdp_pp_and_one_process_and_back(tiny_config, tmp_path):
    cfg = tiny_config(steps=5)
    nproc, layout = DP2_TP2
    train(nproc, cfg, tmp_path / "dp2tp2", *layout, "--checkpoint.every=3")
    loss, norm = curve(tmp_path / "dp2tp2")
    assert len(loss) == 5 and loss[-1] < loss[0]

    for name, (n, options) in LAYOUTS.items():
        resumed = train(n, cfg, tmp_path / name, *options, "--checkpoint.every=4", f"--checkpoint.resume={step(tmp_path / 'dp2tp2', 3)}")
        assert "at step 3" in resumed.stdout, (name, resumed.stdout)
        got = curve(tmp_path / name)
        assert got[0] == pytest.approx(loss[3:], rel=TOL) and got[1] == pytest.approx(norm[3:], rel=TOL), name

        back = tmp_path / f"{name}_back"
        resumed = train(nproc, cfg, back, *layout, f"--checkpoint.resume={step(tmp_path / name, 4)}")
        assert "at step 4" in resumed.stdout, (name, resumed.stdout)
        got = curve(back)
        assert got[0] == pytest.approx(loss[4:], rel=TOL) and got[1] == pytest.approx(norm[4:], rel=TOL), name

    # export and generate read a pipeline (step 4) and a dp x tp (step 5) checkpoint as the one-process one of that step
    for run, n in (("pp2dp2", 4), ("dp2tp2", 5)):
        weights, reference = exported(tmp_path, step(tmp_path / run, n), run), exported(tmp_path, step(tmp_path / "one", n), f"one{n}")
        assert sorted(weights) == sorted(reference)
        for key, w in reference.items():
            torch.testing.assert_close(weights[key], w, rtol=1e-5, atol=1e-5)
        assert greedy(step(tmp_path / run, n)) == greedy(step(tmp_path / "one", n)), run
