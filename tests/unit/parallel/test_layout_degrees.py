"""Layouts by degrees on one mesh (``[parallelism] fsdp2`` with ``tp``, ``pp``): the plan shows the
dp x tp mesh and the batch over the data-parallel ranks; a layout that cannot work is one line,
exit 2, before any process group (``core.plan``, in process)."""

from __future__ import annotations

import json

import pytest
from shared import plan_error

from core.contract.protocols import DistInfo


def test_tensor_parallel_ranks_read_the_same_batches():
    """Consecutive ranks form a tensor-parallel group: ranks 0, 1 are data-parallel rank 0 of 2."""
    got = [(DistInfo(rank=r, world_size=4, tp=2).dp_rank, DistInfo(rank=r, world_size=4, tp=2).dp_size) for r in range(4)]
    assert got == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert (DistInfo(rank=3, world_size=4).dp_rank, DistInfo(rank=3, world_size=4).dp_size) == (3, 4)


def test_the_plan_shows_the_mesh_and_divides_the_batch_over_data_parallel_ranks(tiny_config, capsys):
    from core.cli import plan

    cfg = str(tiny_config())
    args = ["--config", cfg, "--config-only", "--parallelism.name=fsdp2"]
    assert plan.main([*args, "--nproc", "4", "--parallelism.tp=2"]) == 0
    assert "2 micro x 128 seq x 2 data-parallel ranks (4 ranks, tp 2) x 2 accumulation" in capsys.readouterr().out
    assert plan.main([*args, "--nproc", "4", "--parallelism.tp=2", "--json"]) == 0
    tp = json.loads(capsys.readouterr().out)
    assert plan.main([*args, "--nproc", "4", "--json"]) == 0
    dp = json.loads(capsys.readouterr().out)
    assert (tp["mesh"], dp["mesh"], tp["grad_accum"], dp["grad_accum"]) == ({"dp": 2, "tp": 2}, {"dp": 4, "tp": 1}, 2, 1)
    assert tp["memory_per_rank"]["activations_gib"] == pytest.approx(dp["memory_per_rank"]["activations_gib"] / 2)


@pytest.mark.parametrize(
    "nproc, overrides, expected",
    [
        (3, ["--parallelism.tp=2"], "[parallelism] fsdp2: tp = 2 does not divide the world size 3; expected world size = dp x tp"),
        (2, ["--parallelism.pp=2"], "[parallelism] fsdp2: pp = 2: pipeline parallelism is not supported yet; expected pp = 1"),
        (4, ["--parallelism.tp=2", "--parallelism.replicate=2"], "replicate = 2 with tp = 2 is not supported yet"),
        (2, ["--parallelism.tp=2", "--parallelism.cpu_offload=true"], "cpu_offload with tp = 2 is not supported"),
        (4, ["--parallelism.tp=4", "--model.name=recurrent_moe"], "[model] recurrent_moe: n_kv_heads = 2 is not divisible by tp; expected a multiple of 4"),
        (2, ["--parallelism.tp=2", "--model.name=recurrent_moe", "--model.vocab_size=513"], "[model] recurrent_moe: vocab_size = 513 is not divisible by tp"),
        (4, ["--parallelism.tp=4", "--model.n_kv_heads=2"], "[model] llama3: n_kv_heads = 2 is not divisible by tp; expected a multiple of 4"),
        (2, ["--parallelism.tp=2", "--model.loss_chunk_tokens=64"], "loss_chunk_tokens (chunked loss) is not supported under tensor parallelism"),
        (2, ["--parallelism.tp=2", "--precision.name=fp8"], "precision 'fp8' under tensor parallelism is not supported yet"),
        (2, ["--parallelism.tp=2", "--train.compile=true"], "train.compile with tensor parallelism on CPU is not supported (torch "),
        (2, ["--parallelism.tp=2", "--train.micro_batch=auto"], 'train.micro_batch = "auto" with tensor parallelism is not supported yet'),
        (2, ["--parallelism.tp=2", "--data.seq_len=127"], "data.seq_len 127 is not divisible by tp (sequence parallelism splits it)"),
    ],
)
def test_a_layout_that_cannot_work_is_one_line(tiny_config, capsys, nproc, overrides, expected):
    line = plan_error(capsys, "--config", str(tiny_config()), "--config-only", "--nproc", str(nproc), "--parallelism.name=fsdp2", *overrides)
    assert expected in line, line
