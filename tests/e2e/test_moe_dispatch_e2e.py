"""The recurrent MoE's sparse dispatch: the dense model's function (losses, gradients, health metrics),
a capacity factor that drops what exceeds it, FLOPs of the active experts, and a run whose checkpoint
the dense path saved resumed on the sparse path under fsdp2 to the losses of an uninterrupted run."""

from __future__ import annotations

import shutil

import pytest
from conftest import read_metrics, torchrun, write_tiny_config


@pytest.mark.slow
def test_a_dense_checkpoint_resumes_on_the_sparse_path_under_fsdp2(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=4, global_batch_tokens=1024)
    cfg.write_text(cfg.read_text().replace('name = "llama3"\nflavor = "debug"\ndim = 64\nn_layers = 2\n', 'name = "recurrent_moe"\nn_loops = 2\n'))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = torchrun(2, "--config", str(cfg), f"--train.output_dir={straight}", "--parallelism.name=fsdp2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = torchrun(2, "--config", str(cfg), f"--train.output_dir={resumed}", "--model.dispatch=dense", "--checkpoint.every=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.rmtree(resumed / "checkpoints" / "step_000000004")  # the dense run's step 2 is what the sparse run resumes
    proc = torchrun(2, "--config", str(cfg), f"--train.output_dir={resumed}", "--parallelism.name=fsdp2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout, proc.stdout[-2000:]
    want = {r["step"]: r["loss"] for r in read_metrics(straight)}
    got = {r["step"]: r["loss"] for r in read_metrics(resumed)}
    assert sorted(got) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
