"""DCP checkpoints through the real trainer: exact resume, resharded resume, kills, async, corruption."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, env, read_metrics, run_module, start_module, torchrun, torchrun_argv, write_tiny_config
from shared import losses, nbytes

SEAMS = REPO / "tests" / "seams"

pytestmark = pytest.mark.slow


def ckpts(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*") if (p / "COMMITTED").exists())


def train(nproc: int, cfg, out: Path, *extra: str, extra_env=None):
    args = ("--config", str(cfg), f"--train.output_dir={out}", *extra)
    proc = torchrun(nproc, *args, extra_env=extra_env) if nproc > 1 else run_module("core.train", *args, extra_env=extra_env)
    return proc


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One config and one uninterrupted 8-step, 2-rank ddp run (the reference losses) per module."""
    tmp = tmp_path_factory.mktemp("ckpt")
    cfg = write_tiny_config(tmp, steps=8, global_batch_tokens=1024)
    proc = train(2, cfg, tmp / "straight")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cfg, losses(tmp / "straight")


@pytest.fixture
def cfg(shared):
    return shared[0]


@pytest.fixture
def straight(shared):
    return shared[1]


def first_leg(cfg, out: Path, nproc: int, *extra: str) -> None:
    """Train 8 steps saving every 4, then forget everything after step 4."""
    proc = train(nproc, cfg, out, "--checkpoint.every=4", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.rmtree(out / "checkpoints" / "step_000000008")


def second_leg(cfg, out: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    proc = train(nproc, cfg, out, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_000000004 at step 4" in proc.stdout
    return proc


@pytest.fixture(scope="module")
def fsdp2_leg(shared, tmp_path_factory):
    """The first leg on 2 fsdp2 ranks, shared by the resharding tests (each resumes a copy)."""
    out = tmp_path_factory.mktemp("fsdp2_leg") / "run"
    first_leg(shared[0], out, 2, "--parallelism.name=fsdp2")
    return out


def test_exact_resume_same_world_size(cfg, tmp_path, straight):
    out = tmp_path / "resumed"
    first_leg(cfg, out, 2)
    second_leg(cfg, out, 2)
    got = losses(out)
    assert sorted(got) == list(range(1, 9))
    assert [got[s] for s in range(1, 9)] == [straight[s] for s in range(1, 9)]  # bitwise
    state = json.loads((out / "checkpoints" / "step_000000008" / "state.json").read_text())
    assert state["data"]["consumed_samples"] == 8 * 1024 // 128
    assert state["step"] == 8 and state["tokens_seen"] == 8 * 1024


@pytest.mark.parametrize(
    "first, second",
    [
        ("fsdp2", (1, "--parallelism.name=ddp")),
        ("ddp", (2, "--parallelism.name=fsdp2")),
        ("fsdp2", (4, "--parallelism.name=fsdp2", "--train.micro_batch=1")),
    ],
    ids=["fsdp2-2to1-ddp", "ddp-to-fsdp2", "fsdp2-2to4"],
)
def test_resharded_resume_continues_the_global_stream(cfg, tmp_path, straight, fsdp2_leg, first, second):
    out = tmp_path / "resharded"
    if first == "fsdp2":
        shutil.copytree(fsdp2_leg, out)
    else:
        first_leg(cfg, out, 2, f"--parallelism.name={first}")
    second_leg(cfg, out, *second)
    got = losses(out)
    # The same global samples in every step, whatever the world size: the losses of
    # the straight 2-rank run are reproduced up to fp32 summation order.
    for s in range(1, 9):
        assert got[s] == pytest.approx(straight[s], rel=2e-5, abs=2e-5), (s, got, straight)
    info = json.loads((out / "run_info.json").read_text())
    assert info["world_size"] == second[0]


def test_sigkill_during_save_resumes_from_last_complete(cfg, tmp_path):
    out = tmp_path / "killed"
    cmd = torchrun_argv(2, "--config", str(cfg), f"--train.output_dir={out}", "--checkpoint.every=2")
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env(PLAIT_TEST_PAUSE_BEFORE_COMMIT="4:60", PYTHONPATH=os.pathsep.join([str(SEAMS), str(REPO)])),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    target = out / "checkpoints" / "step_000000004"
    deadline = time.time() + 120
    while time.time() < deadline and not (target / ".metadata").exists():
        time.sleep(0.2)
    assert (target / ".metadata").exists(), "the save of step 4 never wrote its shards"
    assert not (target / "COMMITTED").exists()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert ckpts(out) == ["step_000000002"]
    again = train(2, cfg, out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step_000000002 at step 2" in again.stdout
    assert sorted(losses(out)) == list(range(1, 9))


def test_sigterm_stops_at_step_boundary_with_checkpoint(cfg, tmp_path):
    out = tmp_path / "term"
    proc = start_module("core.train", "--config", str(cfg), f"--train.output_dir={out}", "--train.steps=100000")
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 3):
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]
    assert "(signal)" in stdout
    saved = ckpts(out)
    assert len(saved) == 1
    step = int(saved[0].split("_")[1])
    assert step == max(losses(out))  # the checkpoint is the last completed step
    again = train(1, cfg, out, f"--train.steps={step + 2}")
    assert again.returncode == 0 and f"at step {step}" in again.stdout


def same(a, b, where) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("parallelism", [pytest.param("ddp", marks=pytest.mark.bench), "fsdp2", "hsdp"])  # ddp: CI time; fsdp2 and hsdp hold more
def test_async_save_matches_sync(cfg, tmp_path, parallelism):
    """An async save (its copy of the state made in a background thread while the next step runs;
    under fsdp2 each rank's shards as DTensors) writes what a sync save of the same step writes, and
    each rank copies only its half (under ddp and HSDP, where both ranks hold the whole state)."""
    chosen = ["--parallelism.name=fsdp2", "--parallelism.replicate=2"] if parallelism == "hsdp" else [f"--parallelism.name={parallelism}"]
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from core.checkpoint.folders import verify

    outs = {}
    for mode in ("false", "true"):
        out = tmp_path / f"async_{mode}"
        proc = train(2, cfg, out, "--checkpoint.every=4", f"--checkpoint.async={mode}", *chosen)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ckpts(out) == ["step_000000004", "step_000000008"]
        kind = "async" if mode == "true" else "sync"
        assert f"checkpoint step 4: {kind} save stalled training" in proc.stdout
        outs[mode] = out
        if mode == "true":  # each rank copies only what it writes: half of the state, not all of it under ddp
            held = re.search(r"async saves keep ([\d,.]+) MiB of host memory on rank 0", proc.stdout)
            assert held, proc.stdout[-3000:]
            held_bytes = float(held.group(1).replace(",", "")) * 2**20
    for step in ("step_000000004", "step_000000008"):
        verify(outs["true"] / "checkpoints" / step)  # the async save's write-time checksums match the files
        loaded = []
        for mode in ("false", "true"):
            sd: dict = {}
            _load_state_dict(sd, storage_reader=FileSystemReader(str(outs[mode] / "checkpoints" / step)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
            loaded.append(sd)
        model_keys = [k for k in loaded[0] if k.startswith("model")]
        assert model_keys and set(loaded[0]) == set(loaded[1])
        same(loaded[0], loaded[1], step)
        tensor_bytes = nbytes(loaded[0])
        assert 0.4 * tensor_bytes < held_bytes < 0.6 * tensor_bytes, (held_bytes, tensor_bytes)


def test_corrupt_checkpoint_auto_falls_back_explicit_fails(cfg, tmp_path):
    out = tmp_path / "corrupt"
    proc = train(1, cfg, out, "--checkpoint.every=4", "--train.steps=8")
    assert proc.returncode == 0
    newest = out / "checkpoints" / "step_000000008"
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    again = train(1, cfg, out, "--train.steps=9")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "skipping checkpoint" in again.stderr and "truncated or corrupt" in again.stderr
    assert "step_000000004 at step 4" in again.stdout
    bad = run_module("core.train", "--config", str(cfg), f"--train.output_dir={tmp_path / 'x'}", f"--checkpoint.resume={newest}")
    assert bad.returncode == 2
    assert shard.name in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_exclude_optimizer_and_shape_mismatch(cfg, tmp_path):
    out = tmp_path / "excl"
    assert train(1, cfg, out, "--train.steps=4").returncode == 0
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={out}", "--model.dim=96")
    assert proc.returncode == 2
    assert "does not fit the model" in proc.stderr and "attention.wq.weight (64, 64) vs model (96, 96)" in proc.stderr
    proc = train(1, cfg, out, "--train.steps=6", '--checkpoint.exclude_from_loading=["optimizer"]')
    assert proc.returncode == 0 and "at step 4" in proc.stdout


def test_uncommitted_is_ignored_and_keep_latest_prunes(cfg, tmp_path):
    out = tmp_path / "prune"
    proc = train(1, cfg, out, "--checkpoint.every=1", "--checkpoint.keep_latest=2")
    assert proc.returncode == 0
    assert ckpts(out) == ["step_000000007", "step_000000008"]
    (out / "checkpoints" / "step_000000009").mkdir()  # a save that never finished
    again = train(1, cfg, out, "--train.steps=9", "--checkpoint.keep_latest=2")
    assert "step_000000008 at step 8" in again.stdout
