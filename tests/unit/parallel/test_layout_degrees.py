"""Layouts by degrees on one mesh (``[parallelism] fsdp2`` with ``tp``, ``replicate``, ``pp``): the plan
shows the [pp x] dp x tp mesh, the batch over the data-parallel ranks, the memory per rank, the
communication per step and the pipeline's layers per rank and bubble as the layout changes them; a
layout that cannot work is one line, exit 2, before any process group (``core.plan``, in process)."""

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


def test_pipeline_stages_are_the_outer_mesh_dimension():
    """Rank = (stage x dp + dp_rank) x tp + tp_rank: the stages of one pipeline read the same batches."""
    got = [(DistInfo(rank=r, world_size=8, tp=2, pp=2).dp_rank, DistInfo(rank=r, world_size=8, tp=2, pp=2).dp_size) for r in range(8)]
    assert got == [(0, 2), (0, 2), (1, 2), (1, 2)] * 2
    assert [DistInfo(rank=r, world_size=4, pp=2).dp_rank for r in range(4)] == [0, 1, 0, 1]


def test_the_plan_shows_the_pipeline_layers_per_rank_and_its_bubble(tiny_config, capsys):
    from core.cli import plan

    args = ["--config", str(tiny_config()), "--config-only", "--parallelism.name=fsdp2", "--parallelism.pp=2", "--model.n_layers=4"]
    assert plan.main([*args, "--nproc", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["mesh"] == {"pp": 2, "dp": 2, "tp": 1}
    p = got["pipeline"]
    assert (p["stages"], p["stages_per_rank"], p["layers"], p["layers_per_rank"], p["micro_batches"]) == (2, 1, 4, 2, 2)
    assert p["bubble_fraction"] == pytest.approx(1 / 3)  # (p - 1) / (m + p - 1)
    assert got["params_total"] > p["params_per_rank_max"]
    assert plan.main([*args, "--model.vocab_size=512", "--nproc", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    # the first stage holds the embedding (512 x 64) and 2 of 4 blocks, the last 2 blocks, the final norm (64)
    # and the head (64 x 512): the last has the most, half of what is not the final norm, plus the norm
    blocks = got["params_total"] - 2 * 512 * 64 - 64
    assert got["pipeline"]["params_per_rank_max"] == blocks // 2 + 512 * 64 + 64
    assert plan.main([*args, "--nproc", "2", "--parallelism.pipeline_schedule=Interleaved1F1B", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["pipeline"]
    assert (p["stages"], p["stages_per_rank"], p["layers_per_rank"], p["micro_batches"]) == (4, 2, 2, 4)
    assert p["bubble_fraction"] == pytest.approx(1 / 9)  # (p - 1) / (v m + p - 1)
    assert plan.main([*args, "--nproc", "2"]) == 0
    text = capsys.readouterr().out
    assert "pipeline    2 stages (1 per rank): 2 of 4 layers per rank" in text and "4 micro-batches (2 in flight), bubble 20.0% of a step" in text, text


def test_recurrent_moe_stages_are_its_units_and_the_plan_counts_them(tiny_config, capsys):
    """The small flavor's shapes made tiny: 2 prelude blocks, a core of 2 (one unit), 2 coda blocks are
    5 units; 2 stages put both prelude blocks and the core on the first (4 blocks, not an even 3), and
    Interleaved1F1B at pp = 2 has 4 stages: the prelude, the core, each coda block."""
    cfg = tiny_config()
    small = ("--model.name=recurrent_moe", "--model.flavor=small", "--model.dim=64", "--model.ffn_dim=128", "--model.vocab_size=512", "--model.n_experts=4")
    p = plan_json(capsys, cfg, 2, "--parallelism.pp=2", *small)["pipeline"]
    assert (p["stages"], p["layers"], p["layers_per_rank"]) == (2, 6, 4)
    p = plan_json(capsys, cfg, 2, "--parallelism.pp=2", "--parallelism.pipeline_schedule=Interleaved1F1B", *small)["pipeline"]
    assert (p["stages"], p["stages_per_rank"], p["layers_per_rank"]) == (4, 2, 4)  # rank 1: the core, then the last coda block: 2 x 2 at most
    p = plan_json(capsys, cfg, 2, "--parallelism.pp=2", "--model.name=recurrent_moe")["pipeline"]  # debug: prelude and core | coda
    assert (p["layers_per_rank"], p["block_pass_share"]) == (2, pytest.approx(4 / 5))  # the core's block applied 3 times: 4 of 5 passes
    debug = ("--model.name=recurrent_moe", "--parallelism.pp=2", "--parallelism.pipeline_schedule=Interleaved1F1B")
    p = plan_json(capsys, cfg, 2, *debug, "--model.n_prelude=2")["pipeline"]  # the debug flavor's 1 + 1 + 1 blocks with a prelude of 2: 4 units
    assert (p["stages"], p["stages_per_rank"], p["layers"], p["layers_per_rank"]) == (4, 2, 4, 2)


def test_pipeline_stages_divide_weights_and_keep_in_flight_micro_batches(tiny_config, capsys):
    """pp = 2 on 4 ranks vs FSDP over 2 ranks (the same accumulation): a rank holds about half the
    layers' weights and, under 1F1B, one micro-batch's activations in all (its half of the layers for two
    micro-batches in flight); GPipe keeps every micro-batch of the step in flight; FSDP gathers once a
    step under pp, and the stages' sends are named, not estimated."""
    cfg, layers = tiny_config(), "--model.n_layers=4"
    dp = plan_json(capsys, cfg, 2, layers, "--train.micro_batch=1")
    pp = plan_json(capsys, cfg, 4, layers, "--train.micro_batch=1", "--parallelism.pp=2")
    gpipe = plan_json(capsys, cfg, 4, layers, "--train.micro_batch=1", "--parallelism.pp=2", "--parallelism.pipeline_schedule=GPipe")
    assert dp["grad_accum"] == pp["grad_accum"] == pp["pipeline"]["micro_batches"] == 4
    assert pp["mesh"] == {"pp": 2, "dp": 2, "tp": 1}
    assert (pp["pipeline"]["in_flight_micro_batches"], gpipe["pipeline"]["in_flight_micro_batches"]) == (2, 4)
    mem_dp, mem_pp = dp["memory_per_rank"], pp["memory_per_rank"]
    assert 0.5 <= mem_pp["weights_gib"] / mem_dp["weights_gib"] < 1  # half the blocks, the embedding or head whole
    assert mem_pp["activations_gib"] == pytest.approx(mem_dp["activations_gib"])  # 2 of 4 layers x 2 in flight
    assert gpipe["memory_per_rank"]["activations_gib"] == pytest.approx(2 * mem_dp["activations_gib"])
    comm_dp, comm_pp = dp["communication_per_step_gib"], pp["communication_per_step_gib"]
    assert comm_pp["fsdp_all_gather"] < comm_dp["fsdp_all_gather"] / 4  # once a step, on a stage's share, not 2 x 4 micro-batches
    assert comm_pp["pp"] is None and "pp" not in comm_dp


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


def plan_json(capsys, cfg, nproc, *overrides):
    from core.cli import plan

    capsys.readouterr()
    assert plan.main(["--config", str(cfg), "--config-only", "--nproc", str(nproc), "--parallelism.name=fsdp2", *overrides, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_tensor_parallelism_divides_weights_activations_and_fsdp_traffic_and_adds_its_own(tiny_config, capsys):
    """Two data-parallel ranks either way: tp = 2 halves what a rank holds (llama3: all but the norms), its
    activations and its FSDP all-gather and reduce-scatter, and adds TP's collectives, which grow with tp."""
    cfg, kv = tiny_config(), "--model.n_kv_heads=4"  # tp = 4 splits them too
    dp = plan_json(capsys, cfg, 2, kv)
    tp = plan_json(capsys, cfg, 4, "--parallelism.tp=2", kv)
    tp4 = plan_json(capsys, cfg, 8, "--parallelism.tp=4", kv)
    for key in ("weights_gib", "grads_gib", "optimizer_gib"):
        assert 0.5 < tp["memory_per_rank"][key] / dp["memory_per_rank"][key] < 0.51, key  # the norms stay whole
    assert tp["memory_per_rank"]["activations_gib"] == pytest.approx(dp["memory_per_rank"]["activations_gib"] / 2)
    # the same accumulation (two data-parallel ranks), FSDP's collectives on half the weights
    comm_dp, comm_tp = dp["communication_per_step_gib"], tp["communication_per_step_gib"]
    assert dp["grad_accum"] == tp["grad_accum"] == 2
    assert 0.5 < comm_tp["fsdp_all_gather"] / comm_dp["fsdp_all_gather"] < 0.51
    assert 0.5 < comm_tp["fsdp_reduce_scatter"] / comm_dp["fsdp_reduce_scatter"] < 0.51
    assert "tp" not in comm_dp and comm_tp["tp"] > 0
    # (8 x 2 layers + 4) collectives of the 2 x 128 x 64 fp32 residual stream, half of it sent, per micro-batch
    assert comm_tp["tp"] == pytest.approx(2 * 20 * 2 * 128 * 64 * 4 / 2 / 2**30)  # x 2 micro-batches
    assert tp4["communication_per_step_gib"]["tp"] == pytest.approx(comm_tp["tp"] * 1.5)  # (tp - 1) / tp, the same accumulation


def test_recurrent_moe_keeps_its_experts_whole_under_tensor_parallelism(tiny_config, capsys):
    """recurrent_moe's MoE layers stay whole on every tp rank: tp = 2 divides its weights by much less than 2."""
    cfg = tiny_config()
    moe = ("--model.name=recurrent_moe",)
    dp = plan_json(capsys, cfg, 2, *moe)["memory_per_rank"]
    tp = plan_json(capsys, cfg, 4, "--parallelism.tp=2", *moe)["memory_per_rank"]
    assert 0.75 < tp["weights_gib"] / dp["weights_gib"] < 1
    assert 0.5 < tp["activations_gib"] / dp["activations_gib"] < 1


def test_expert_parallelism_divides_the_experts_by_the_world_size_and_prices_the_all_to_all(tiny_config, capsys):
    """recurrent_moe on 4 ranks: under ep the experts are split over ep and each part FSDP-sharded over
    the replicas, so ep 2 and ep 4 hold what fsdp 4 holds (1 / 4 of every parameter); the other units'
    gathers leave the experts out, which (ep 2) gather their own halves over the 2 replicas and
    reduce-scatter their gradients there; the all-to-all grows as (ep - 1) / ep."""
    from core.cli import plan

    cfg = tiny_config()
    moe = ("--model.name=recurrent_moe",)
    fsdp, ep2, ep4 = (plan_json(capsys, cfg, 4, *moe, *ep) for ep in ((), ("--parallelism.ep=2",), ("--parallelism.ep=4",)))
    assert ep2["mesh"] == {"dp": 4, "tp": 1, "replica": 2, "ep": 2} and ep4["mesh"] == {"dp": 4, "tp": 1, "replica": 1, "ep": 4}
    for kind in ("weights_gib", "grads_gib", "optimizer_gib"):
        m1, m2, m4 = (p["memory_per_rank"][kind] for p in (fsdp, ep2, ep4))
        assert m2 == pytest.approx(m1) and m4 == pytest.approx(m1), kind  # every parameter / 4, experts included
    c1, c2, c4 = (p["communication_per_step_gib"] for p in (fsdp, ep2, ep4))
    assert c2["fsdp_all_gather"] == pytest.approx(c4["fsdp_all_gather"])
    experts = (c1["fsdp_all_gather"] - c2["fsdp_all_gather"]) / (fsdp["grad_accum"] * 2 * 3 / 4)  # GiB of all the experts' fp32 weights
    assert 0.5 * 4 * fsdp["memory_per_rank"]["weights_gib"] < experts < 4 * fsdp["memory_per_rank"]["weights_gib"]  # most of the model
    assert c2["expert_all_gather"] == pytest.approx(fsdp["grad_accum"] * 2 * 1 / 2 * experts / 2)  # each half, over 2 replicas
    assert c2["expert_reduce_scatter"] == pytest.approx(1 / 2 * experts / 2) and "expert_all_gather" not in c4
    assert "ep_all_to_all" not in c1 and c2["ep_all_to_all"] > 0 and c4["ep_all_to_all"] == pytest.approx(c2["ep_all_to_all"] * 1.5)
    assert plan.main(["--config", str(cfg), "--config-only", "--nproc", "4", "--parallelism.name=fsdp2", "--parallelism.ep=2", *moe]) == 0
    text = capsys.readouterr().out
    assert "mesh        dp 4 x tp 1, experts on replica 2 x ep 2" in text and "EP all-to-all" in text and "experts' all-gather" in text, text


def test_expert_parallelism_inside_pipeline_stages_splits_each_stages_experts(tiny_config, capsys):
    """recurrent_moe, pp 2 x ep 2 on 4 ranks: each stage's 2 data-parallel ranks are one ep group (replica
    1), so a rank holds what pp 2 alone holds (its stage's experts / 2); the experts are not gathered,
    and the all-to-all is the stage's share of the block applications."""
    cfg = tiny_config()
    moe = ("--model.name=recurrent_moe", "--validation.every=0")
    pp2, pp2ep2, ep2 = (
        plan_json(capsys, cfg, n, *moe, *o)
        for n, o in ((4, ("--parallelism.pp=2",)), (4, ("--parallelism.pp=2", "--parallelism.ep=2")), (2, ("--parallelism.ep=2",)))
    )
    assert pp2ep2["mesh"] == {"pp": 2, "dp": 2, "tp": 1, "replica": 1, "ep": 2}
    for kind in ("weights_gib", "grads_gib", "optimizer_gib"):
        assert pp2ep2["memory_per_rank"][kind] == pytest.approx(pp2["memory_per_rank"][kind]), kind
    c = pp2ep2["communication_per_step_gib"]
    assert "expert_all_gather" not in c and c["fsdp_all_gather"] < pp2["communication_per_step_gib"]["fsdp_all_gather"]
    stage = 4 / 5  # the first stage's block applications: the prelude's once, the core's 3 times, of 5 (the coda's on the second)
    assert pp2ep2["pipeline"]["block_pass_share"] == pytest.approx(stage)
    assert c["ep_all_to_all"] == pytest.approx(ep2["communication_per_step_gib"]["ep_all_to_all"] * stage)  # dp 2 either way: the same accumulation


def test_expert_parallelism_under_hsdp_splits_a_replica_groups_experts(tiny_config, capsys):
    """recurrent_moe, replicate 2 x ep 2 on 4 ranks: each replica group's 2 shard ranks are one ep group,
    so a rank holds what HSDP alone holds (1 / 2 of every parameter); the experts' shards are all-reduced
    over the replicate groups, together with the others' what HSDP alone all-reduces."""
    cfg = tiny_config()
    moe = ("--model.name=recurrent_moe",)
    hsdp, hsdp_ep = (plan_json(capsys, cfg, 4, *moe, "--parallelism.replicate=2", *o) for o in ((), ("--parallelism.ep=2",)))
    assert hsdp_ep["mesh"] == {"dp": 4, "replicate": 2, "shard": 2, "tp": 1, "replica": 1, "ep": 2}
    for kind in ("weights_gib", "grads_gib", "optimizer_gib"):
        assert hsdp_ep["memory_per_rank"][kind] == pytest.approx(hsdp["memory_per_rank"][kind]), kind
    c, c0 = hsdp_ep["communication_per_step_gib"], hsdp["communication_per_step_gib"]
    assert c["hsdp_all_reduce"] + c["expert_all_reduce"] == pytest.approx(c0["hsdp_all_reduce"])
    assert "expert_all_gather" not in c and c["ep_all_to_all"] > 0


def test_expert_parallelism_under_tensor_parallelism_splits_the_experts_over_the_data_parallel_ranks(tiny_config, capsys):
    """recurrent_moe, dp 2 x tp 2 x ep 2 on 4 ranks: every tp rank runs the MoE layers whole, so the ep
    groups are the data-parallel ranks and a rank holds what dp 2 x tp 2 holds (the experts / 2); the
    experts leave the other units' gathers, and each pair of tp ranks exchanges whole micro-batches."""
    cfg = tiny_config()
    moe = ("--model.name=recurrent_moe",)
    tp, tp_ep, ep = (
        plan_json(capsys, cfg, n, *moe, *o)
        for n, o in ((4, ("--parallelism.tp=2",)), (4, ("--parallelism.tp=2", "--parallelism.ep=2")), (2, ("--parallelism.ep=2",)))
    )
    assert tp_ep["mesh"] == {"dp": 2, "tp": 2, "replica": 1, "ep": 2}
    for kind in ("weights_gib", "grads_gib", "optimizer_gib"):
        assert tp_ep["memory_per_rank"][kind] == pytest.approx(tp["memory_per_rank"][kind]), kind
    c = tp_ep["communication_per_step_gib"]
    assert c["fsdp_all_gather"] < tp["communication_per_step_gib"]["fsdp_all_gather"] and "expert_all_gather" not in c
    assert c["ep_all_to_all"] == pytest.approx(ep["communication_per_step_gib"]["ep_all_to_all"])  # dp 2 either way


def test_hsdp_with_tensor_parallelism_is_a_three_dimensional_mesh(tiny_config, capsys):
    """replicate 2 x shard 1 x tp 2: nothing sharded (no all-gather), the gradients all-reduced across the replicas."""
    got = plan_json(capsys, tiny_config(), 4, "--parallelism.tp=2", "--parallelism.replicate=2")
    assert got["mesh"] == {"dp": 2, "replicate": 2, "shard": 1, "tp": 2}
    comm = got["communication_per_step_gib"]
    assert "fsdp_all_gather" not in comm and comm["hsdp_all_reduce"] > 0 and comm["tp"] > 0


@pytest.mark.parametrize(
    "nproc, overrides, expected",
    [
        (3, ["--parallelism.tp=2"], "[parallelism] fsdp2: tp = 2 does not divide the world size 3; expected world size = dp x tp"),
        (3, ["--parallelism.pp=2"], "[parallelism] fsdp2: pp = 2 x tp = 1 does not divide the world size 3; expected world size = pp x dp x tp"),
        (4, ["--parallelism.pp=2", "--parallelism.replicate=2"], "pp = 2 with replicate > 1 or cpu_offload is not supported yet"),
        (
            4,
            ["--parallelism.pp=4", "--model.name=recurrent_moe"],
            "[parallelism]: 4 pipeline stages but recurrent_moe splits only between its 3 units (each of its 1 prelude and 1 coda blocks, and the looped core",
        ),
        (
            2,
            ["--parallelism.pp=2", "--model.name=recurrent_moe", "--parallelism.pipeline_schedule=Interleaved1F1B"],
            "4 pipeline stages but recurrent_moe splits",
        ),
        (4, ["--parallelism.pp=4"], "[parallelism]: 4 pipeline stages but the model has 2 layers; expected at most one stage per layer"),
        (2, ["--parallelism.pp=2", "--parallelism.pipeline_schedule=Interleaved1F1B"], "4 pipeline stages but the model has 2 layers"),
        (2, ["--parallelism.pp=2", "--model.tie_embeddings=true"], "[model] tie_embeddings with 2 pipeline stages is not supported"),
        (2, ["--parallelism.pp=2", "--validation.every=3"], "validation during training with pipeline parallelism is not supported yet"),
        (2, ["--parallelism.pp=2", "--train.micro_batch=auto"], 'train.micro_batch = "auto" with pipeline parallelism is not supported'),
        (
            4,
            ["--parallelism.pp=2", "--train.micro_batch=4"],
            "pp = 2: 1 micro-batch(es) per step (global_batch_tokens / (micro_batch x seq_len x data-parallel ranks)) is below the stage count; expected at least 2",
        ),
        (
            2,
            [
                "--parallelism.pp=2",
                "--parallelism.pipeline_schedule=Interleaved1F1B",
                "--model.n_layers=4",
                "--train.micro_batch=1",
                "--data.seq_len=256",
                "--train.global_batch_tokens=768",
            ],
            "pipeline_schedule = 'Interleaved1F1B' with pp = 2 runs micro-batches in rounds of 2, but a step has 3; expected a multiple of 2",
        ),
        (
            8,
            ["--nproc-per-node=2", "--parallelism.tp=4"],
            "[parallelism] tp = 4 does not divide the 2 ranks of a node; expected a divisor of the ranks per node",
        ),
        (4, ["--parallelism.tp=2", "--parallelism.replicate=4"], "replicate = 4 does not divide the 2 data-parallel ranks (world size 4 / tp 2)"),
        (2, ["--parallelism.tp=2", "--parallelism.cpu_offload=true"], "cpu_offload with tp = 2 is not supported"),
        (4, ["--parallelism.tp=4", "--model.name=recurrent_moe"], "[model] recurrent_moe: n_kv_heads = 2 is not divisible by tp; expected a multiple of 4"),
        (2, ["--parallelism.tp=2", "--model.name=recurrent_moe", "--model.vocab_size=513"], "[model] recurrent_moe: vocab_size = 513 is not divisible by tp"),
        (4, ["--parallelism.tp=4", "--model.n_kv_heads=2"], "[model] llama3: n_kv_heads = 2 is not divisible by tp; expected a multiple of 4"),
        (2, ["--parallelism.tp=2", "--model.loss_chunk_tokens=64"], "loss_chunk_tokens (chunked loss) is not supported under tensor parallelism"),
        (
            2,
            ["--parallelism.tp=2", "--precision.name=mxfp8"],
            "[parallelism] tp = 2: [precision] mxfp8 under tensor parallelism is not supported: torchao's MXFP8 training linear",
        ),
        (2, ["--parallelism.tp=2", "--precision.name=te_fp8"], "[parallelism] tp = 2: [precision] te_fp8 under tensor parallelism is not supported"),
        (
            2,
            ["--parallelism.tp=2", "--train.compile=true", "--train.activation_checkpointing=full"],
            "train.compile with full activation checkpointing under tensor parallelism is not supported (torch ",
        ),
        (2, ["--parallelism.tp=2", "--train.micro_batch=auto"], 'train.micro_batch = "auto" with tensor parallelism is not supported yet'),
        (2, ["--parallelism.tp=2", "--data.seq_len=127"], "data.seq_len 127 is not divisible by tp (sequence parallelism splits it)"),
    ],
)
def test_a_layout_that_cannot_work_is_one_line(tiny_config, capsys, nproc, overrides, expected):
    line = plan_error(capsys, "--config", str(tiny_config()), "--config-only", "--nproc", str(nproc), "--parallelism.name=fsdp2", *overrides)
    assert expected in line, line
