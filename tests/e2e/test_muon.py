"""The ``muon`` optimizer through the trainer: bad options refused in one line by ``core.train`` and
``core.plan``, and (slow) the same updates under ddp, fsdp2 and HSDP, exact resumes, resumes across
world sizes and optimizers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_module, torchrun, write_tiny_config
from shared import losses


def one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("plait: error: ") and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    "override, named",
    [
        ("--optimizer.momentum=1.0", "momentum"),
        ("--optimizer.ns_steps=0", "ns_steps"),
        ("--optimizer.ns_eps=0", "ns_eps"),
        ("--optimizer.adamw_betas=[0.9, 1.5]", "adamw_betas"),
        ('--optimizer.adjust_lr="rms"', "adjust_lr"),
        ("--optimizer.ns_coefficients=[3.4, -4.7]", "ns_coefficients"),
        ("--optimizer.lr_multipliers={head = 2.0}", "head"),
    ],
)
def test_out_of_range_options_are_one_line_naming_the_key_in_train_and_plan(tiny_config, override, named):
    cfg = str(tiny_config())
    lines = {one_error_line(run_module(cmd, "--config", cfg, "--optimizer.name=muon", override, timeout=120)) for cmd in ("core.train", "core.plan")}
    assert len(lines) == 1, lines  # core.plan says the same
    line = lines.pop()
    assert "[optimizer]" in line and named in line, line


# -- through the trainer: ddp, fsdp2, HSDP, resumes -------------------------------------------------


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint, read in this process (torch.load of DCP's own conversion)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=True)["model"]


MUON = ("--optimizer.name=muon", "--optimizer.weight_decay=0.01", "--checkpoint.every=3")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """6 Muon steps of the tiny llama (untied head) on 2 ranks under ddp, fsdp2 and HSDP (2 replicas x 1 shard)."""
    tmp = tmp_path_factory.mktemp("muon2")
    cfg = write_tiny_config(tmp, steps=6)
    runs = {}
    for name, extra in [
        ("ddp", ["--parallelism.name=ddp"]),
        ("fsdp2", ["--parallelism.name=fsdp2"]),
        ("hsdp", ["--parallelism.name=fsdp2", "--parallelism.replicate=2"]),
    ]:
        out = tmp / name
        proc = torchrun(2, "--config", str(cfg), f"--train.output_dir={out}", *MUON, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = out
    return cfg, runs


@pytest.mark.slow
def test_fsdp2_and_hsdp_give_ddps_updates_on_two_ranks(two_rank_runs):
    """The sharded matrices are orthogonalized whole: after 6 steps the weights match ddp's within
    2e-4, a small part of what steps 4-6 moved them, the losses within 1e-4 (relative)."""
    _, runs = two_rank_runs
    ref = weights(runs["ddp"] / "checkpoints" / "step_000000006")
    start = weights(runs["ddp"] / "checkpoints" / "step_000000003")
    for name in ("fsdp2", "hsdp"):
        got = weights(runs[name] / "checkpoints" / "step_000000006")
        assert got.keys() == ref.keys()
        for key in ref:
            assert torch.allclose(got[key], ref[key], rtol=0, atol=2e-4), (name, key, (got[key] - ref[key]).abs().max())
        moved = max((ref[k] - start[k]).abs().max().item() for k in ref if "layers" in k and ref[k].ndim == 2)
        assert moved > 20 * 2e-4, moved  # 8.8e-3 here: the warm-up LR of base.toml's schedule
        a, b = losses(runs[name]), losses(runs["ddp"])
        assert sorted(a) == list(range(1, 7)) and all(a[s] == pytest.approx(b[s], rel=1e-4) for s in a), (a, b)


@pytest.mark.slow
def test_a_two_rank_fsdp2_checkpoint_resumes_on_one_rank(two_rank_runs, tmp_path):
    """Momentum buffers and AdamW moments saved sharded on 2 ranks, resumed on 1: the losses of steps
    4-6 are the 2-rank run's up to the summation order of the gradients."""
    cfg, runs = two_rank_runs
    out = tmp_path / "one"
    shutil.copytree(runs["fsdp2"], out, ignore=shutil.ignore_patterns("step_000000006*"))
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={out}", *MUON)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 3 (saved on 2 ranks, now 1)" in proc.stdout, proc.stdout
    assert "optimizer started fresh" not in proc.stdout
    got, ref = losses(out), losses(runs["fsdp2"])
    assert all(got[s] == pytest.approx(ref[s], rel=1e-4) for s in (4, 5, 6)), (got, ref)


@pytest.mark.slow
def test_resume_is_exact_and_a_resume_into_adamw_or_back_starts_the_optimizer_fresh(tmp_path):
    """One process: 6 steps straight; the same from step 3's checkpoint (bitwise); from step 3 with
    adamw (muon's state is not loaded, said once) and from that run's step 6 with muon again."""
    cfg = write_tiny_config(tmp_path, steps=6)
    straight = tmp_path / "straight"
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={straight}", *MUON)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, other = tmp_path / "resumed", tmp_path / "adamw"
    for copy in (resumed, other):
        shutil.copytree(straight, copy, ignore=shutil.ignore_patterns("step_000000006"))
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={resumed}", *MUON)
    assert proc.returncode == 0 and "at step 3" in proc.stdout, proc.stderr[-3000:]
    assert "optimizer started fresh" not in proc.stdout and "holds optimizer state" not in proc.stderr
    assert losses(resumed) == losses(straight)  # bitwise, steps 1-6

    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={other}", "--optimizer.name=adamw", "--checkpoint.every=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("holds optimizer state of 'muon', this run uses 'adamw'") == 1
    assert "at step 3" in proc.stdout and "optimizer started fresh" in proc.stdout
    assert sorted(losses(other)) == list(range(1, 7))
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={other}", *MUON, "--train.steps=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("holds optimizer state of 'adamw', this run uses 'muon'") == 1
    assert "at step 6" in proc.stdout and sorted(losses(other)) == list(range(1, 9))
