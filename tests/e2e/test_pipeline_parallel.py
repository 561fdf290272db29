"""Pipeline parallelism (``[parallelism] fsdp2`` with ``pp``, ``torch.distributed.pipelining``) on CPU
with gloo, real processes: 2 stages on 2 ranks under 1F1B, GPipe and Interleaved1F1B (4 stages, two
per rank), pp 2 x dp 2 (with activation checkpointing), pp 2 x tp 2, and the 3-D pp 2 x dp 2 x tp 2 on
8 ranks give the losses and gradient norms of one process over 5 steps (relative tolerance 1e-5: the
same float32 math summed in another order; seen: below 3e-7), and log the same metrics (every key
but the timings, each value within the same tolerance), the document mask with per-document RoPE
positions too; a pp 2 x dp 2 checkpoint (each stage's ranks write their own FQNs) resumes on one
process and a one-process checkpoint under pp 2 x dp 2, with the uninterrupted run's next losses, and
export reads the pipeline checkpoint as the whole model. recurrent_moe too: pp 2 under 1F1B and GPipe,
pp 2 x dp 2, pp 2 x tp 2 and the 3-D layout on 8 ranks equal one process, its step metrics included (loss parts and MoE health:
each stage records what it runs, the ranks' records combine into the one-process values; tokens per
expert exactly), Interleaved1F1B over its single prelude and coda blocks and its core (4 stages of 5
units) too, and its pp 2 x dp 2 checkpoint resumes on one process. Compiled blocks (pp 2, pp 2 x tp 2) too."""

from __future__ import annotations

import pytest
import torch
from conftest import read_metrics, run_module, torchrun
from safetensors.torch import load_file
from test_tensor_parallel import TOL, curve, short_documents, train

pytestmark = pytest.mark.slow

PP = ("--parallelism.name=fsdp2", "--parallelism.pp=2")


TIMINGS = {"data_wait_s", "elapsed_s", "eta_s", "step_time_s", "tokens_per_s", "tokens_per_s_per_device"}
MOE_METRICS = ("lm", "aux", "z", "moe/router_entropy", "moe/load_imbalance", "moe/expert_tokens", "moe/loop_cos_min", "moe/expert_spread_min")


def assert_equal(out, reference):
    loss, norm = curve(out)
    assert loss == pytest.approx(reference[0], rel=TOL) and norm == pytest.approx(reference[1], rel=TOL)


def assert_same_metrics(out, reference_out):
    """Every logged training row has the reference run's keys, and each value but the timings equal to
    its value there: numbers within the relative TOL, integers and lists (tokens per expert) exactly."""
    rows, reference = read_metrics(out), read_metrics(reference_out)
    assert len(rows) == len(reference) == 5
    for row, ref in zip(rows, reference):
        assert set(row) == set(ref), (out, set(row) ^ set(ref))
        for key in set(ref) - TIMINGS:
            if isinstance(ref[key], float):
                assert row[key] == pytest.approx(ref[key], rel=TOL), (out, row["step"], key)
            else:
                assert row[key] == ref[key], (out, row["step"], key)


def test_pipeline_schedules_and_layouts_equal_one_process_and_checkpoints_move_between_layouts(tiny_config, tmp_path):
    cfg = tiny_config(steps=5)
    train(1, cfg, tmp_path / "one", "--parallelism.name=single", "--checkpoint.every=3")
    one = curve(tmp_path / "one")
    assert len(one[0]) == 5 and one[0][-1] < one[0][0]

    for schedule in ("1F1B", "GPipe"):
        proc = train(2, cfg, tmp_path / schedule, *PP, f"--parallelism.pipeline_schedule={schedule}")
        assert "x 1 data-parallel ranks (2 ranks, pp 2) x 4 accumulation" in proc.stdout, proc.stdout
        assert_equal(tmp_path / schedule, one)
        assert_same_metrics(tmp_path / schedule, tmp_path / "one")

    proc = train(4, cfg, tmp_path / "pp2dp2", *PP, "--train.activation_checkpointing=full", "--checkpoint.every=3")
    assert "x 2 data-parallel ranks (4 ranks, pp 2) x 2 accumulation" in proc.stdout, proc.stdout
    assert_equal(tmp_path / "pp2dp2", one)
    assert_same_metrics(tmp_path / "pp2dp2", tmp_path / "one")

    train(4, cfg, tmp_path / "pp2tp2", *PP, "--parallelism.tp=2")
    assert_equal(tmp_path / "pp2tp2", one)
    assert_same_metrics(tmp_path / "pp2tp2", tmp_path / "one")

    # the pp 2 x dp 2 run's step-3 checkpoint on one process, and the one-process checkpoint under pp 2 x dp 2
    for nproc, out, layout, saved in ((1, "one_again", ("--parallelism.name=single",), "pp2dp2"), (4, "pp2dp2_again", PP, "one")):
        ckpt = tmp_path / saved / "checkpoints" / "step_000000003"
        resumed = train(nproc, cfg, tmp_path / out, *layout, f"--checkpoint.resume={ckpt}")
        assert "at step 3" in resumed.stdout, resumed.stdout
        loss, norm = curve(tmp_path / out)
        assert loss == pytest.approx(one[0][3:], rel=TOL) and norm == pytest.approx(one[1][3:], rel=TOL)

    # export reads the pipeline checkpoint as the whole model: the one-process weights
    weights = {}
    for run in ("one", "pp2dp2"):
        exported = tmp_path / run / "exported"
        proc = run_module(
            "core.export", "--checkpoint", str(tmp_path / run / "checkpoints" / "step_000000003"), "--format", "safetensors", "--out", str(exported)
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        weights[run] = load_file(exported / "model.safetensors")
    assert sorted(weights["pp2dp2"]) == sorted(weights["one"])
    for name, w in weights["one"].items():
        torch.testing.assert_close(weights["pp2dp2"][name], w, rtol=1e-5, atol=1e-5)


def test_interleaved_schedule_and_the_document_mask_equal_one_process(tiny_config, tmp_path):
    """Four stages of one layer, two per rank (rank 0: stages 0 and 2), with the document mask and
    per-document RoPE positions computed on every stage from the micro-batch's tokens."""
    data = short_documents(tmp_path)
    cfg = tiny_config(steps=5)
    options = ("--model.n_layers=4", "--model.attention_mask=document", "--model.rope_positions=document", f"--data.path={data}")
    train(1, cfg, tmp_path / "one", "--parallelism.name=single", *options)
    one = curve(tmp_path / "one")
    train(2, cfg, tmp_path / "interleaved", *PP, "--parallelism.pipeline_schedule=Interleaved1F1B", "--train.activation_checkpointing=selective", *options)
    assert_equal(tmp_path / "interleaved", one)
    assert_same_metrics(tmp_path / "interleaved", tmp_path / "one")


@pytest.mark.parametrize("model", ["llama3", "recurrent_moe"])
def test_three_dimensional_pp_dp_tp_on_eight_ranks_equals_one_process(tiny_config, tmp_path, model):
    cfg = tiny_config(steps=5)
    train(1, cfg, tmp_path / "one", "--parallelism.name=single", f"--model.name={model}")
    proc = torchrun(8, "--config", str(cfg), f"--train.output_dir={tmp_path / 'three_d'}", *PP, "--parallelism.tp=2", f"--model.name={model}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "x 2 data-parallel ranks (8 ranks, tp 2, pp 2) x 2 accumulation" in proc.stdout, proc.stdout
    assert_equal(tmp_path / "three_d", curve(tmp_path / "one"))
    assert_same_metrics(tmp_path / "three_d", tmp_path / "one")


def test_recurrent_moe_stages_and_step_metrics_equal_one_process_and_a_pipeline_checkpoint_resumes_on_one_process(tiny_config, tmp_path):
    """The prelude and the looped core on stage 0, the coda on stage 1: the load-balancing and z-loss
    sums travel with the hidden states, and the loss and its gradients are the one-process ones; each
    stage records its blocks' routing (and the loop cosines, the loss parts where it holds the core, the
    head), and the logged step metrics are the one-process run's."""
    cfg = tiny_config(steps=5)
    moe = "--model.name=recurrent_moe"
    train(1, cfg, tmp_path / "one", "--parallelism.name=single", moe)
    one = curve(tmp_path / "one")
    assert all(key in row for row in read_metrics(tmp_path / "one") for key in MOE_METRICS)
    for schedule in ("1F1B", "GPipe"):
        train(2, cfg, tmp_path / schedule, *PP, f"--parallelism.pipeline_schedule={schedule}", moe)
        assert_equal(tmp_path / schedule, one)
        assert_same_metrics(tmp_path / schedule, tmp_path / "one")
    train(4, cfg, tmp_path / "pp2dp2", *PP, "--checkpoint.every=3", moe)
    assert_equal(tmp_path / "pp2dp2", one)
    assert_same_metrics(tmp_path / "pp2dp2", tmp_path / "one")
    train(4, cfg, tmp_path / "pp2tp2", *PP, "--parallelism.tp=2", moe)  # the MoE layers whole on each tp rank of a stage
    assert_equal(tmp_path / "pp2tp2", one)
    assert_same_metrics(tmp_path / "pp2tp2", tmp_path / "one")
    ckpt = tmp_path / "pp2dp2" / "checkpoints" / "step_000000003"
    resumed = train(1, cfg, tmp_path / "one_again", "--parallelism.name=single", f"--checkpoint.resume={ckpt}", moe)
    assert "at step 3" in resumed.stdout, resumed.stdout
    loss, norm = curve(tmp_path / "one_again")
    assert loss == pytest.approx(one[0][3:], rel=TOL) and norm == pytest.approx(one[1][3:], rel=TOL)


def test_recurrent_moe_interleaved_over_its_single_prelude_and_coda_blocks_equals_one_process(tiny_config, tmp_path):
    """The small flavor's shapes made tiny: 2 prelude blocks, a core of 2 looped 4 times, 2 coda blocks are
    5 units in 4 stages, two per rank (rank 0: both prelude blocks, then the first coda block; rank 1: the
    core, then the last coda block and the head), with the document mask, per-document RoPE positions and
    selective checkpointing: the losses, gradient norms and step metrics of one process."""
    data = short_documents(tmp_path)
    cfg = tiny_config(steps=5)
    shape = ("--model.flavor=small", "--model.dim=64", "--model.ffn_dim=128", "--model.vocab_size=512", "--model.n_experts=4")
    options = ("--model.name=recurrent_moe", *shape, "--model.attention_mask=document", "--model.rope_positions=document", f"--data.path={data}")
    train(1, cfg, tmp_path / "one", "--parallelism.name=single", *options)
    train(2, cfg, tmp_path / "interleaved", *PP, "--parallelism.pipeline_schedule=Interleaved1F1B", "--train.activation_checkpointing=selective", *options)
    assert_equal(tmp_path / "interleaved", curve(tmp_path / "one"))
    assert_same_metrics(tmp_path / "interleaved", tmp_path / "one")


def test_compiled_blocks_in_pipeline_stages_equal_one_process(tiny_config, tmp_path):
    """train.compile under pp 2 and under pp 2 x tp 2 with selective checkpointing (4 ranks): each stage's
    blocks compiled, the losses and gradient norms of one process."""
    cfg = tiny_config(steps=5)
    train(1, cfg, tmp_path / "one", "--parallelism.name=single")
    one = curve(tmp_path / "one")
    proc = train(2, cfg, tmp_path / "pp2", *PP, "--train.compile=true")
    assert "compile on" in proc.stdout, proc.stdout
    assert_equal(tmp_path / "pp2", one)
    proc = train(4, cfg, tmp_path / "pp2tp2", *PP, "--parallelism.tp=2", "--train.compile=true", "--train.activation_checkpointing=selective")
    assert "compile on" in proc.stdout, proc.stdout
    assert_equal(tmp_path / "pp2tp2", one)
