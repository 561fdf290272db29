"""The model specs' pipeline stages (``pipeline_stages``), in one process: llama3's blocks split evenly
in order, recurrent_moe between its units (each prelude block, the looped core, each coda block); each
pruned model's state dict holds only its stages' names (together: the whole model's, unchanged), the
stages run one after another give the whole model's loss and gradients, and recurrent_moe's stages'
records its step metrics."""

from __future__ import annotations

import copy

import pytest
import torch

from model_specs.llama3.pipeline import layer_ranges
from model_specs.llama3.spec import Llama3Spec


def test_blocks_split_evenly_in_order():
    assert layer_ranges(4, 2) == [range(0, 2), range(2, 4)]
    assert layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]


@pytest.mark.parametrize("stage_sets", [[[0], [1]], [[0, 2], [1, 3]]])
def test_stages_hold_their_own_names_and_chain_to_the_whole_models_loss(stage_sets):
    torch.manual_seed(0)
    spec = Llama3Spec.from_flavor("debug", n_layers=4, dim=64, attention_mask="document", rope_positions="document")
    spec.use_end_of_document_id(7)
    whole = spec.build()
    spec.init_weights(whole)
    ids = torch.randint(0, 32, (2, 16))  # many end-of-document ids (7): the mask and positions matter
    labels = torch.randint(0, 32, (2, 16))
    expected = whole(ids, labels)
    expected.backward()
    n_stages = sum(len(s) for s in stage_sets)
    ranks = [copy.deepcopy(whole) for _ in stage_sets]
    stages: dict[int, torch.nn.Module] = {}
    for model, ids_of_rank in zip(ranks, stage_sets):
        model.zero_grad(set_to_none=True)
        stages |= dict(zip(ids_of_rank, spec.pipeline_stages(model, ids_of_rank, n_stages)))
    names = [set(m.state_dict()) for m in ranks]
    assert not names[0] & names[1] and names[0] | names[1] == set(whole.state_dict())
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[1]
    h = None
    for s in range(n_stages):
        h = stages[s](h, tokens=ids, labels=labels) if s else stages[s](tokens=ids, labels=labels)
    assert h is not None and h.dim() == 0
    torch.testing.assert_close(h, expected, rtol=1e-6, atol=1e-6)
    h.backward()
    grads = {n: p.grad for m in ranks for n, p in m.named_parameters()}
    for n, p in whole.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)


SMALL_TINY = dict(flavor="small", dim=64, ffn_dim=128, vocab_size=512, n_experts=4)  # 2 prelude, a core of 2, 2 coda blocks


def over_ranks(parts_of_ranks):
    """Each part reduced over the ranks by its op, as core.contract.metrics.reduce_parts does after its all_gather."""
    ops = {"sum": lambda c: c.sum(0), "min": lambda c: c.min(0).values}
    return {name: ops[op](torch.stack([parts[name][1].double() for parts in parts_of_ranks])) for name, (op, _) in parts_of_ranks[0].items()}


@pytest.mark.parametrize(
    "options, stage_sets, units_of_stages",
    [
        ({}, [[0], [1]], [["prelude.0", "core"], ["coda.0"]]),
        (SMALL_TINY, [[0, 2], [1, 3]], [["prelude.0", "prelude.1"], ["core"], ["coda.0"], ["coda.1"]]),
    ],
    ids=["debug-2-stages", "small-interleaved-4-stages"],
)
def test_recurrent_moe_stages_chain_to_the_whole_models_loss_and_step_metrics(options, stage_sets, units_of_stages):
    """Its units (each prelude block, the looped core, each coda block) split evenly in order: the aux and
    z sums carried from stage to stage to the loss; each stage records what it ran, a shape-inference run
    on placeholders (NaN) first replaced by micro-batch 0's, and the ranks' records together give the
    whole model's step metrics."""
    from model_specs.recurrent_moe.model import RecurrentMoEOptions
    from model_specs.recurrent_moe.spec import RecurrentMoESpec

    torch.manual_seed(0)
    spec = RecurrentMoESpec.from_options(RecurrentMoEOptions(**options))
    whole = spec.build()
    spec.init_weights(whole)
    ids, labels = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    ranks = [copy.deepcopy(whole) for _ in stage_sets]
    whole.log_step(True)
    expected = whole(ids, labels)
    expected.backward()
    n_stages = sum(len(s) for s in stage_sets)
    stages: dict[int, torch.nn.Module] = {}
    for model, ids_of_rank in zip(ranks, stage_sets):
        stages |= dict(zip(ids_of_rank, spec.pipeline_stages(model, ids_of_rank, n_stages)))
        model.zero_grad(set_to_none=True)
        model.log_step(True)
    assert [stages[s].held for s in range(n_stages)] == units_of_stages
    names = [set(m.state_dict()) for m in ranks]
    assert not names[0] & names[1] and names[0] | names[1] == set(whole.state_dict())
    first = torch.tensor([0])
    placeholder = (torch.full((2, 16, 64), float("nan")), torch.zeros(()), torch.zeros(()))
    for s in range(n_stages):  # the schedule's shape inference: every stage once, micro-batch 0's slot
        stages[s](*(() if s == 0 else placeholder), tokens=ids, labels=labels, micro_batch=first)
    out: tuple = ()
    for s in range(n_stages):
        out = stages[s](*out, tokens=ids, labels=labels, micro_batch=first)
        out = out if isinstance(out, tuple) else (out,)
    loss = out[0]
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    loss.backward()
    grads = {n: p.grad for m in ranks for n, p in m.named_parameters() if p.grad is not None}
    for n, p in whole.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)
    parts_of_ranks: list[dict] = []
    for model in ranks:  # the parts each rank hands to the reduction
        model.step_metrics(lambda parts: (parts_of_ranks.append(parts), {k: v for k, (_, v) in parts.items()})[1])
    combined = over_ranks(parts_of_ranks)
    got, want = ranks[0].step_metrics(lambda parts: combined), whole.extra_metrics()
    assert set(got) == set(want) and "moe/expert_spread_min" in got, got
    assert got["moe/expert_tokens"] == want["moe/expert_tokens"]
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key
