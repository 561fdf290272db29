"""Document masking: a packed sequence's logits are those of each of its documents run alone
(llama3 and recurrent_moe, RoPE positions absolute or restarting per document), documents are found
in the ids on the device, and a document mask without an end-of-document id is refused before anything runs."""

from __future__ import annotations

import pytest
import torch

from model_specs.llama3.model import document_layout
from model_specs.llama3.spec import Llama3Spec
from model_specs.recurrent_moe.spec import RecurrentMoEOptions, RecurrentMoESpec

EOD = 7


def build(kind: str, **over):
    spec = Llama3Spec.from_flavor("debug", dim=64, n_layers=2, **over) if kind == "llama3" else RecurrentMoESpec.from_options(RecurrentMoEOptions(**over))
    spec.use_end_of_document_id(EOD)
    torch.manual_seed(0)
    model = spec.build()
    spec.init_weights(model)
    return model.eval()


def test_documents_and_positions_are_read_from_the_ids():
    ids = torch.tensor([[5, 6, EOD, 9, EOD, 3, 4, 2]])  # starts mid-document; ends mid-document
    doc, pos = document_layout(ids, EOD)
    assert doc.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


@pytest.mark.parametrize("kind", ["llama3", "recurrent_moe"])
@pytest.mark.parametrize("rope", ["absolute", "document"])
def test_packed_logits_equal_each_document_run_alone(kind, rope):
    model = build(kind, attention_mask="document", rope_positions=rope)
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(10, 500, (n,), generator=g) for n in (9, 14, 6)]
    docs = [torch.cat([d[:-1], torch.tensor([EOD])]) for d in docs[:2]] + [docs[2]]  # the last one is cut off by the window
    packed = torch.cat(docs)[None]
    with torch.no_grad():
        logits = model(packed)[0]
        start = 0
        for d in docs:
            alone = model(d[None])[0]
            assert torch.allclose(logits[start : start + len(d)], alone, atol=2e-5), (start, (logits[start : start + len(d)] - alone).abs().max())
            start += len(d)
        causal = build(kind)(packed)[0]
    assert torch.allclose(logits[: len(docs[0])], causal[: len(docs[0])], atol=2e-5)  # the first document sees nothing else either way
    assert not torch.allclose(logits[len(docs[0]) :], causal[len(docs[0]) :], atol=1e-3)  # the others did see earlier documents


def test_the_document_mask_trains_the_same_loss_as_the_documents_alone():
    """Gradients flow through the masked path (SDPA with a boolean mask) on CPU."""
    model = build("llama3", attention_mask="document", rope_positions="document").train()
    ids = torch.tensor([[11, 12, 13, EOD, 21, 22, EOD, 31]])
    loss = model(ids, ids)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_document_mask_without_an_end_of_document_id_is_refused():
    spec = Llama3Spec.from_flavor("debug", attention_mask="document")
    from core.api import ConfigError

    with pytest.raises(ConfigError, match=r'attention_mask = "document" needs the end-of-document id of the data'):
        spec.use_end_of_document_id(None)
    plain = Llama3Spec.from_flavor("debug")
    plain.use_end_of_document_id(None)  # a causal model needs none
    assert plain.eod_id is None


def test_hf_export_says_the_mask_is_not_applied(capsys):
    spec = Llama3Spec.from_flavor("debug", attention_mask="document")
    model = spec.build()
    spec.to_hf_state_dict(model.state_dict())
    assert "LlamaForCausalLM does not apply that mask" in capsys.readouterr().err


def test_sources_say_where_documents_end():
    from conftest import REPO

    from core.api import PluginError, data_end_of_document_id
    from plugins.data.mixture import Mixture, MixtureOptions
    from plugins.data.synthetic import Synthetic, SyntheticOptions
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    corpus = str(REPO / "plugins" / "data" / "corpus" / "shakespeare")
    assert data_end_of_document_id(TokenBin(TokenBinOptions(path=corpus)), "bin") == 256  # meta.json's eos_id
    assert data_end_of_document_id(Synthetic(SyntheticOptions()), "synthetic") is None
    mixed = Mixture(MixtureOptions(sources=[{"name": "token_bin", "weight": 1.0, "path": corpus}, {"name": "synthetic", "weight": 1.0}]))
    assert data_end_of_document_id(mixed, "mixture") == 256

    class Odd:
        def end_of_document_id(self):
            return -1

    with pytest.raises(PluginError, match=r"odd: end_of_document_id\(\) returned -1; expected a token id"):
        data_end_of_document_id(Odd(), "odd")
