"""Expert parallelism (``[parallelism] fsdp2`` with ``ep``) for ``recurrent_moe`` on CPU with gloo, real
processes: the experts split over 2 and 4 ranks, and over 2 of 4 ranks (each half of the experts
FSDP-sharded over two replicas, so a rank holds a quarter of them; with and without full activation
checkpointing, so the exchange runs again in the recompute), give the losses and gradient norms of
one process, dropless and with a capacity factor (relative tolerance 1e-5: the same float32 math,
each expert's rows summed in another order); an ep = 2 checkpoint resumes on one process, and a
one-process checkpoint under ep = 2 (DCP reshards the stacked experts); a checkpoint of ep 2 on 4
ranks resumes under fsdp on 4 ranks and on one process, and theirs back under ep 2 on 4 ranks; pp 2 x
ep 2 on 4 ranks (each stage's experts split over its 2 data-parallel ranks) equals one process and its
checkpoints move to one process and back; replicate 2 x ep 2 on 4 ranks (HSDP) equals one process and
its checkpoint resumes on one process, and so do dp 2 x tp 2 x ep 2 on 4 ranks (the experts split over
the data-parallel ranks, repeated over tp); all at the uninterrupted run's losses. The document mask
with per-document RoPE positions under ep = 2 equals one process too, and so do compiled blocks under
ep 2 on 4 ranks; a degree that cannot work is one
line, exit 2, before any process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import read_metrics, run_module, torchrun, write_tiny_config
from test_tensor_parallel import short_documents

pytestmark = pytest.mark.slow

TOL = 1e-5  # relative, on loss and gradient norm


def moe_config(tmp: Path) -> Path:
    """recurrent_moe debug (4 experts, top-2, 2 loops), 5 steps of 2048 tokens: 4 micro-batches of 2 x 128 on one process."""
    cfg = write_tiny_config(tmp, steps=5, global_batch_tokens=2048)
    cfg.write_text(cfg.read_text().replace('name = "llama3"\nflavor = "debug"\ndim = 64\nn_layers = 2\n', 'name = "recurrent_moe"\nn_loops = 2\n'))
    return cfg


def curve(out: Path) -> tuple[list[float], list[float]]:
    rows = read_metrics(out)
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def train(nproc: int, cfg: Path, out: Path, *args: str):
    argv = ("--config", str(cfg), f"--train.output_dir={out}", *args)
    proc = run_module("core.train", *argv) if nproc == 1 else torchrun(nproc, *argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def step(run: Path, n: int) -> Path:
    return run / "checkpoints" / f"step_{n:09d}"


EP2_OF_4 = ("--parallelism.name=fsdp2", "--parallelism.ep=2")
EXPERT_PARAMS = 3 * 4 * 3 * 64 * 128  # debug: 3 MoE layers of 4 experts, three [dim 64 x ffn_dim 128] matrices each


def test_expert_parallel_equals_one_process_and_its_checkpoints_move_between_layouts(tmp_path):
    cfg = moe_config(tmp_path)
    train(1, cfg, tmp_path / "one", "--parallelism.name=single", "--checkpoint.every=3")
    one_loss, one_norm = curve(tmp_path / "one")
    assert len(one_loss) == 5 and one_loss[-1] < one_loss[0]
    for nproc, ep, extra in ((2, 2, ()), (4, 4, ()), (4, 2, ()), (4, 2, ("--train.activation_checkpointing=full",))):
        out = tmp_path / f"ep{ep}_of_{nproc}{'_ac' if extra else ''}"
        proc = train(nproc, cfg, out, "--parallelism.name=fsdp2", f"--parallelism.ep={ep}", "--checkpoint.every=3", *extra)
        # each rank holds 1 / world size of the experts: ep splits them, FSDP shards each part over the replicas
        assert f"{EXPERT_PARAMS // nproc:,} of their {EXPERT_PARAMS:,} parameters on this rank" in proc.stdout, proc.stdout[-3000:]
        loss, norm = curve(out)
        assert loss == pytest.approx(one_loss, rel=TOL) and norm == pytest.approx(one_norm, rel=TOL), (nproc, ep, loss, one_loss, norm, one_norm)
    # the ep = 2 run's step-3 checkpoint on one process, and the one-process step-3 checkpoint under ep = 2
    for nproc, out, saved, layout in (
        (1, "one_again", "ep2_of_2", ("--parallelism.name=single",)),
        (2, "ep2_again", "one", ("--parallelism.name=fsdp2", "--parallelism.ep=2")),
    ):
        resumed = train(nproc, cfg, tmp_path / out, *layout, f"--checkpoint.resume={step(tmp_path / saved, 3)}")
        assert "at step 3" in resumed.stdout, resumed.stdout
        assert [r["step"] for r in read_metrics(tmp_path / out)] == [4, 5]
        loss, norm = curve(tmp_path / out)
        assert loss == pytest.approx(one_loss[3:], rel=TOL) and norm == pytest.approx(one_norm[3:], rel=TOL), (out, loss, one_loss[3:])
    # ep 2 on 4 ranks (experts sharded over two replicas) at step 3 under fsdp 4 and on one process; theirs at step 4 back
    for name, nproc, layout in (("fsdp4", 4, ("--parallelism.name=fsdp2",)), ("one_of_ep2_of_4", 1, ("--parallelism.name=single",))):
        resumed = train(nproc, cfg, tmp_path / name, *layout, "--checkpoint.every=4", f"--checkpoint.resume={step(tmp_path / 'ep2_of_4', 3)}")
        assert "at step 3" in resumed.stdout, (name, resumed.stdout)
        loss, norm = curve(tmp_path / name)
        assert loss == pytest.approx(one_loss[3:], rel=TOL) and norm == pytest.approx(one_norm[3:], rel=TOL), (name, loss, one_loss[3:])
        back = tmp_path / f"{name}_back"
        resumed = train(4, cfg, back, *EP2_OF_4, f"--checkpoint.resume={step(tmp_path / name, 4)}")
        assert "at step 4" in resumed.stdout, (name, resumed.stdout)
        loss, norm = curve(back)
        assert loss == pytest.approx(one_loss[4:], rel=TOL) and norm == pytest.approx(one_norm[4:], rel=TOL), (name, loss, one_loss[4:])


def test_expert_parallel_inside_pipeline_stages_equals_one_process_and_its_checkpoints_move_to_one_process_and_back(tmp_path):
    """pp 2 x ep 2 on 4 ranks: each stage's 2 data-parallel ranks split its MoE layers' experts (half of
    the stage's experts per rank), 1F1B over 4 micro-batches; the one-process losses and gradient norms;
    its step-3 checkpoint on one process, and the one-process one under pp 2 x ep 2."""
    cfg = moe_config(tmp_path)
    pp2_ep2 = ("--parallelism.name=fsdp2", "--parallelism.pp=2", "--parallelism.ep=2", "--checkpoint.every=3")
    train(1, cfg, tmp_path / "one", "--parallelism.name=single", "--checkpoint.every=3")
    one_loss, one_norm = curve(tmp_path / "one")
    proc = train(4, cfg, tmp_path / "pp2ep2", *pp2_ep2)
    stage = EXPERT_PARAMS * 2 // 3  # rank 0's stage: the prelude and the core, 2 of the 3 MoE layers
    assert f"{stage // 2:,} of their {stage:,} parameters on this rank" in proc.stdout, proc.stdout[-3000:]
    loss, norm = curve(tmp_path / "pp2ep2")
    assert loss == pytest.approx(one_loss, rel=TOL) and norm == pytest.approx(one_norm, rel=TOL), (loss, one_loss, norm, one_norm)
    for nproc, out, saved, layout in (
        (1, "one_again", "pp2ep2", ("--parallelism.name=single",)),
        (4, "pp2ep2_again", "one", pp2_ep2),
    ):
        resumed = train(nproc, cfg, tmp_path / out, *layout, f"--checkpoint.resume={step(tmp_path / saved, 3)}")
        assert "at step 3" in resumed.stdout, resumed.stdout
        loss, norm = curve(tmp_path / out)
        assert loss == pytest.approx(one_loss[3:], rel=TOL) and norm == pytest.approx(one_norm[3:], rel=TOL), (out, loss, one_loss[3:])


def test_expert_parallel_under_hsdp_equals_one_process_and_its_checkpoint_resumes_on_one_process(tmp_path):
    """replicate 2 x ep 2 on 4 ranks: each replica group's 2 ranks split the experts, repeated on the other
    group (HSDP, the experts' gradients all-reduced over the groups); the one-process losses and gradient
    norms; its step-3 checkpoint on one process."""
    cfg = moe_config(tmp_path)
    train(1, cfg, tmp_path / "one", "--parallelism.name=single")
    one_loss, one_norm = curve(tmp_path / "one")
    proc = train(4, cfg, tmp_path / "hsdp_ep2", *EP2_OF_4, "--parallelism.replicate=2", "--checkpoint.every=3")
    assert f"replicated over replicate 2: {EXPERT_PARAMS // 2:,} of their {EXPERT_PARAMS:,} parameters on this rank" in proc.stdout, proc.stdout[-3000:]
    loss, norm = curve(tmp_path / "hsdp_ep2")
    assert loss == pytest.approx(one_loss, rel=TOL) and norm == pytest.approx(one_norm, rel=TOL), (loss, one_loss, norm, one_norm)
    resumed = train(1, cfg, tmp_path / "one_again", "--parallelism.name=single", f"--checkpoint.resume={step(tmp_path / 'hsdp_ep2', 3)}")
    assert "at step 3" in resumed.stdout, resumed.stdout
    loss, norm = curve(tmp_path / "one_again")
    assert loss == pytest.approx(one_loss[3:], rel=TOL) and norm == pytest.approx(one_norm[3:], rel=TOL), (loss, one_loss[3:])


def test_expert_parallel_with_tensor_parallelism_equals_one_process_and_its_checkpoint_resumes_on_one_process(tmp_path):
    """dp 2 x tp 2 x ep 2 on 4 ranks: every tp rank runs the MoE layers on the whole micro-batch, so the two
    data-parallel ranks of each tp index split the experts (repeated over tp); the one-process losses and
    gradient norms; its step-3 checkpoint on one process."""
    cfg = moe_config(tmp_path)
    train(1, cfg, tmp_path / "one", "--parallelism.name=single")
    one_loss, one_norm = curve(tmp_path / "one")
    proc = train(4, cfg, tmp_path / "tp2ep2", *EP2_OF_4, "--parallelism.tp=2", "--checkpoint.every=3")
    assert f"{EXPERT_PARAMS // 2:,} of their {EXPERT_PARAMS:,} parameters on this rank" in proc.stdout, proc.stdout[-3000:]
    loss, norm = curve(tmp_path / "tp2ep2")
    assert loss == pytest.approx(one_loss, rel=TOL) and norm == pytest.approx(one_norm, rel=TOL), (loss, one_loss, norm, one_norm)
    resumed = train(1, cfg, tmp_path / "one_again", "--parallelism.name=single", f"--checkpoint.resume={step(tmp_path / 'tp2ep2', 3)}")
    assert "at step 3" in resumed.stdout, resumed.stdout
    loss, norm = curve(tmp_path / "one_again")
    assert loss == pytest.approx(one_loss[3:], rel=TOL) and norm == pytest.approx(one_norm[3:], rel=TOL), (loss, one_loss[3:])


def test_compiled_blocks_under_expert_parallelism_equal_one_process(tmp_path):
    """train.compile with ep 2 on 4 ranks (the experts FSDP-sharded over 2 replicas) and selective
    checkpointing: each block compiled with its all-to-alls, the losses and gradient norms of one process."""
    cfg = moe_config(tmp_path)
    train(1, cfg, tmp_path / "one", "--parallelism.name=single")
    proc = train(4, cfg, tmp_path / "ep2", *EP2_OF_4, "--train.compile=true", "--train.activation_checkpointing=selective")
    assert "compile on" in proc.stdout, proc.stdout
    loss, norm = curve(tmp_path / "ep2")
    one_loss, one_norm = curve(tmp_path / "one")
    assert loss == pytest.approx(one_loss, rel=TOL) and norm == pytest.approx(one_norm, rel=TOL)


def test_expert_parallel_with_a_capacity_factor_drops_what_one_process_drops(tmp_path):
    """capacity_factor = 1: each rank drops, of its own routed pairs, those one process drops of the same
    micro-batch (before sending), so the losses are the one-process ones; they differ from dropless."""
    cfg = moe_config(tmp_path)
    cap = "--model.capacity_factor=1.0"
    train(1, cfg, tmp_path / "one", "--parallelism.name=single", cap)
    one_loss, one_norm = curve(tmp_path / "one")
    train(1, cfg, tmp_path / "dropless", "--parallelism.name=single", "--train.steps=2")
    assert curve(tmp_path / "dropless")[0] != pytest.approx(one_loss[:2], rel=1e-4)  # the capacity did drop pairs
    for nproc in (2, 4):
        out = tmp_path / f"ep{nproc}"
        train(nproc, cfg, out, "--parallelism.name=fsdp2", f"--parallelism.ep={nproc}", cap)
        loss, norm = curve(out)
        assert loss == pytest.approx(one_loss, rel=TOL) and norm == pytest.approx(one_norm, rel=TOL), (nproc, loss, one_loss)


def test_expert_parallel_with_the_document_mask_equals_one_process(tmp_path):
    """Each rank routes its own tokens of micro-batches whose attention stops at document ends (and
    RoPE positions restart there): ep = 2 on 2 ranks gives the one-process losses."""
    cfg = moe_config(tmp_path)
    data = short_documents(tmp_path)
    mask = ("--model.attention_mask=document", "--model.rope_positions=document", f"--data.path={data}")
    train(1, cfg, tmp_path / "one", "--parallelism.name=single", *mask)
    one_loss, one_norm = curve(tmp_path / "one")
    train(2, cfg, tmp_path / "ep2", "--parallelism.name=fsdp2", "--parallelism.ep=2", *mask)
    loss, norm = curve(tmp_path / "ep2")
    assert loss == pytest.approx(one_loss, rel=TOL) and norm == pytest.approx(one_norm, rel=TOL), (loss, one_loss)


def test_an_expert_parallel_degree_that_does_not_divide_the_world_is_one_line_under_train(tmp_path):
    cfg = moe_config(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    proc = torchrun(2, "--config", str(cfg), f"--train.output_dir={out}", "--parallelism.name=fsdp2", "--parallelism.ep=4")
    assert proc.returncode == 1, proc.stderr[-3000:]  # torchrun turns a child's exit code 2 into 1; exit_status.json keeps it
    status = json.loads((out / "exit_status.json").read_text())
    assert (status["exit_code"], status["reason"]) == (2, "bad_input"), status
    assert "[parallelism] fsdp2: ep = 4 does not divide the world size 2" in proc.stderr, proc.stderr[-3000:]
    assert not (out / "metrics.jsonl").is_file() or not read_metrics(out)


def test_fewer_experts_than_ranks_shards_them_on_their_width(tmp_path):
    """2 experts under ep 2 on 4 ranks: one expert per ep rank, which FSDP shards over the 2 replicas on
    its second dimension (the first has one row); the one-process losses, a quarter of the experts per rank."""
    cfg = moe_config(tmp_path)
    two = ("--model.n_experts=2", "--model.top_k=1")
    train(1, cfg, tmp_path / "one", "--parallelism.name=single", *two)
    one_loss, one_norm = curve(tmp_path / "one")
    proc = train(4, cfg, tmp_path / "ep2", *EP2_OF_4, *two)
    assert f"{EXPERT_PARAMS // 2 // 4:,} of their {EXPERT_PARAMS // 2:,} parameters on this rank" in proc.stdout, proc.stdout[-3000:]
    loss, norm = curve(tmp_path / "ep2")
    assert loss == pytest.approx(one_loss, rel=TOL) and norm == pytest.approx(one_norm, rel=TOL), (loss, one_loss)
