"""Parallelism on CPU with gloo: fsdp2 and ddp agree, fsdp2 with CPU offload trains, saves and resumes on
one process, activation checkpointing gives the same losses and names, per-block compile trains, and
two nodes meet through c10d rendezvous."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, env, free_port, read_metrics, run_module, torchrun, write_tiny_config


def losses(out):
    return [r["loss"] for r in read_metrics(out)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The losses of the tiny config's 4 steps on one process, unwrapped, eager, without activation
    checkpointing: what every other way of running that config must give."""
    tmp = tmp_path_factory.mktemp("plain")
    proc = run_module("core.train", "--config", str(write_tiny_config(tmp, steps=4)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = losses(tmp / "out")
    assert len(got) == 4
    return got


@pytest.mark.slow
@pytest.mark.bench  # six 2-rank jobs; `pytest -m bench`
def test_fsdp2_and_ddp_agree(tiny_config, tmp_path):
    cfg = tiny_config(steps=5)
    got = {}
    for par in ("ddp", "fsdp2"):
        proc = torchrun(2, "--config", str(cfg), f"--parallelism.name={par}", f"--train.output_dir={tmp_path / par}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "is deprecated" not in proc.stderr, proc.stderr[-3000:]  # every run would print it (torch 2.13 renamed broadcast_buffers)
        got[par] = losses(tmp_path / par)
    assert len(got["ddp"]) == 5
    assert got["fsdp2"] == pytest.approx(got["ddp"], rel=1e-5)
    assert got["ddp"][-1] < got["ddp"][0]
    # ddp broadcasts no buffers by default: llama3's RoPE tables are the same on every rank, so the
    # losses equal those of a run that broadcasts them before every forward
    proc = torchrun(2, "--config", str(cfg), "--parallelism.name=ddp", "--parallelism.broadcast_buffers=true", f"--train.output_dir={tmp_path / 'bcast'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is deprecated" not in proc.stderr, proc.stderr[-3000:]
    assert losses(tmp_path / "bcast") == got["ddp"]
    # the batched copy of gradients into the buckets (torch 2.13, on by default) changes no bit of
    # training, here with 2 micro-batches per step (the first under no_sync)
    proc = torchrun(2, "--config", str(cfg), "--parallelism.name=ddp", "--parallelism.batched_grad_copy=false", f"--train.output_dir={tmp_path / 'per_param'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "accumulation = " in proc.stdout and "x 2 accumulation" in proc.stdout, proc.stdout
    assert losses(tmp_path / "per_param") == got["ddp"]
    # HSDP: a 2-D mesh of 2 replicas x 1 shard (all-reduce across replicas, sharding within) agrees too
    proc = torchrun(2, "--config", str(cfg), "--parallelism.name=fsdp2", "--parallelism.replicate=2", f"--train.output_dir={tmp_path / 'hsdp'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path / "hsdp") == pytest.approx(got["ddp"], rel=1e-5)


@pytest.mark.slow
def test_fsdp2_cpu_offload_on_one_process_trains_saves_and_resumes(tiny_config, tmp_path, plain):
    """The single-GPU big-model path (8b on one H100) on CPU: a one-rank group of the plugin's own,
    shards in host memory; same losses as the unwrapped model, and a checkpoint that resumes."""
    cfg = tiny_config(steps=4)
    out = tmp_path / "offload"
    args = ("--config", str(cfg), f"--train.output_dir={out}", "--parallelism.name=fsdp2", "--parallelism.cpu_offload=true")
    proc = run_module("core.train", *args, "--checkpoint.every=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optimizer state offloaded to host memory (1 rank(s))" in proc.stdout
    assert losses(out) == pytest.approx(plain, rel=1e-5)
    again = run_module("core.train", *args, "--train.steps=6")
    assert again.returncode == 0 and "at step 4" in again.stdout, again.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)][-2:] == [5, 6]


def test_activation_checkpointing_same_losses_same_names(tiny_config, tmp_path, plain):
    from core.loop.parallelize import apply_activation_checkpointing
    from model_specs.llama3.spec import Llama3Spec

    cfg = tiny_config(steps=4)
    got = {"none": plain}
    for mode in ("full", "selective"):
        proc = run_module("core.train", "--config", str(cfg), f"--train.activation_checkpointing={mode}", f"--train.output_dir={tmp_path / mode}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[mode] = losses(tmp_path / mode)
    assert got["full"] == pytest.approx(got["none"], rel=1e-6)
    assert got["selective"] == pytest.approx(got["none"], rel=1e-6)
    spec = Llama3Spec.from_flavor("debug", dim=64)
    model = spec.build()
    names = list(model.state_dict())
    apply_activation_checkpointing(model, spec, "full", 2)
    assert list(model.state_dict()) == names  # checkpoints stay portable between AC on and off
    assert len(spec.blocks(model)) == 2


@pytest.mark.slow
def test_compile_per_block_trains(tiny_config, tmp_path, plain):
    """One torch.compile test (15-25 s of compilation on CPU)."""
    cfg = tiny_config(steps=4)
    proc = run_module("core.train", "--config", str(cfg), "--train.compile=true", f"--train.output_dir={tmp_path / 'c'}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(tmp_path / "c") == pytest.approx(plain, rel=1e-3)
    ckpt = json.loads((tmp_path / "c" / "checkpoints" / "step_000000004" / "COMMITTED").read_text())
    assert ckpt["step"] == 4


@pytest.mark.slow
def test_two_nodes_c10d_rendezvous(tiny_config, tmp_path):
    cfg = tiny_config(steps=4)
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=1",
                f"--node_rank={rank}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=plait-test",
                "-m",
                "core.train",
                "--config",
                str(cfg),
            ],
            cwd=REPO,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    info = json.loads((tmp_path / "out" / "run_info.json").read_text())
    assert info["world_size"] == 2
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2, 3, 4]
