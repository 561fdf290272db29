"""The recurrent MoE's sparse dispatch through the trainer on 2 ranks: ddp and fsdp2 (experts sharded
with their block) train it to the same losses, a run interrupted after its step-2 checkpoint and resumed
gives an uninterrupted run's losses bitwise under each, and a checkpoint the dense path saved resumes on
the sparse path under fsdp2 to the losses of an uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import torchrun, write_tiny_config
from shared import losses

STEPS = 4


def moe_config(tmp: Path) -> Path:
    cfg = write_tiny_config(tmp, steps=STEPS, global_batch_tokens=1024)
    cfg.write_text(cfg.read_text().replace('name = "llama3"\nflavor = "debug"\ndim = 64\nn_layers = 2\n', 'name = "recurrent_moe"\nn_loops = 2\n'))
    return cfg


def losses_after_the_resume(out: Path) -> tuple[int, dict[int, float]]:
    """The step the last ``resume`` line names, and the losses logged after it (what the resumed run computed)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    at = max(i for i, r in enumerate(rows) if r["kind"] == "resume")
    return rows[at]["step"], {r["step"]: r["loss"] for r in rows[at + 1 :] if r["kind"] == "train"}


@pytest.fixture(scope="module")
def sparse_runs(tmp_path_factory):
    """4 sparse steps on 2 ranks under ddp and under fsdp2, checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("moe_sparse")
    cfg = moe_config(tmp)
    runs = {}
    for name in ("ddp", "fsdp2"):
        out = tmp / name
        proc = torchrun(2, "--config", str(cfg), f"--train.output_dir={out}", f"--parallelism.name={name}", "--checkpoint.every=2")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = out
    return cfg, runs


@pytest.mark.slow
def test_sparse_dispatch_trains_under_ddp_and_fsdp2_and_resumes_exactly(sparse_runs, tmp_path):
    cfg, runs = sparse_runs
    ddp, fsdp2 = losses(runs["ddp"]), losses(runs["fsdp2"])
    assert sorted(ddp) == sorted(fsdp2) == list(range(1, STEPS + 1))
    assert all(fsdp2[s] == pytest.approx(ddp[s], rel=1e-5) for s in ddp), (fsdp2, ddp)  # up to the gradients' reduction order
    for name, straight in runs.items():
        resumed = tmp_path / name
        shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step_000000004"))
        proc = torchrun(2, "--config", str(cfg), f"--train.output_dir={resumed}", f"--parallelism.name={name}", "--checkpoint.every=2")
        assert proc.returncode == 0, proc.stderr[-3000:]
        at, got = losses_after_the_resume(resumed)
        want = losses(straight)
        assert at == 2 and got == {s: want[s] for s in (3, 4)}, (name, got, want)  # bitwise


@pytest.mark.slow
def test_a_dense_checkpoint_resumes_on_the_sparse_path_under_fsdp2(sparse_runs, tmp_path):
    cfg, runs = sparse_runs
    resumed = tmp_path / "resumed"
    proc = torchrun(2, "--config", str(cfg), f"--train.output_dir={resumed}", "--model.dispatch=dense", "--checkpoint.every=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.rmtree(resumed / "checkpoints" / "step_000000004")  # the dense run's step 2 is what the sparse run resumes
    proc = torchrun(2, "--config", str(cfg), f"--train.output_dir={resumed}", "--parallelism.name=fsdp2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout, proc.stdout[-2000:]
    want = losses(runs["fsdp2"])
    got = losses(resumed)
    assert sorted(got) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
