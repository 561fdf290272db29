"""The model specs' pipeline stages (``pipeline_stages``), in one process: llama3's blocks split evenly
in order, recurrent_moe between its prelude, looped core and coda; each pruned model's state dict holds
only its stages' names (together: the whole model's, unchanged), and the stages run one after another
give the whole model's loss and gradients."""

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


def test_recurrent_moe_stages_chain_to_the_whole_models_loss():
    """Prelude + looped core, then coda: the aux and z sums carried from the first stage to the loss."""
    from model_specs.recurrent_moe.model import RecurrentMoEOptions
    from model_specs.recurrent_moe.spec import RecurrentMoESpec

    torch.manual_seed(0)
    spec = RecurrentMoESpec.from_options(RecurrentMoEOptions(flavor="debug"))
    whole = spec.build()
    spec.init_weights(whole)
    ids, labels = torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))
    expected = whole(ids, labels)
    expected.backward()
    ranks = [copy.deepcopy(whole) for _ in range(2)]
    first, last = (spec.pipeline_stages(m, [s], 2)[0] for m, s in zip(ranks, (0, 1)))
    for m in ranks:
        m.zero_grad(set_to_none=True)
    names = [set(m.state_dict()) for m in ranks]
    assert not names[0] & names[1] and names[0] | names[1] == set(whole.state_dict())
    loss = last(*first(tokens=ids, labels=labels), tokens=ids, labels=labels)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    loss.backward()
    grads = {n: p.grad for m in ranks for n, p in m.named_parameters() if p.grad is not None}
    for n, p in whole.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)
