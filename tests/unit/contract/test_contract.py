"""What a factory returns is held to core/contract/members.py before anything is built: one line naming
the plugin and the member, for a missing member, a wrong arity or a malformed optional one."""

from __future__ import annotations

import pytest

from core.config.registry import load
from core.contract.errors import PluginError
from core.contract.members import CONTRACT, check_component, describe_contract


class Spec:
    vocab_size = 512

    def build(self): ...
    def init_weights(self, model): ...
    def blocks(self, model): ...
    def flops_per_token(self, seq_len):
        return 1.0

    def activation_bytes(self, micro_batch, seq_len, bytes_per_element):
        return 0


class NoActivationBytes(Spec):
    activation_bytes = None  # type: ignore[assignment]


class DictCounts(Spec):
    def param_counts(self):  # an innocent helper with a declared name, but the wrong shape
        return {"total": 1}


class WrongArity(Spec):
    def flops_per_token(self):  # type: ignore[override]
        return 1.0


class BadMaxSeq(Spec):
    max_seq_len = "2048"


class StringDtype:  # a precision whose param_dtype is a name, not a torch.dtype: fsdp2 failed on it mid-build
    name, param_dtype = "mine", "bfloat16"

    def supported(self, device): ...
    def convert(self, model, spec): ...
    def autocast(self, device): ...
    def metrics(self, model): ...


class NoMultiplier:
    def multiply(self, step, total):
        return 1.0


NEEDS = {  # components whose defaults need input
    ("data", "mixture"): {"sources": [{"name": "synthetic", "weight": 1.0}]},
    ("data", "token_bin"): {"path": "plugins/data/corpus/shakespeare"},
    ("data", "text_stream"): {"files": ["x.jsonl"]},
}


def test_every_builtin_component_meets_the_contract():
    from core.contract.option_values import build_options

    registry = load()
    checked = 0
    for slot in CONTRACT:
        for component in registry.components(slot):
            table = NEEDS.get((slot, component.name), {})
            obj = component.factory(build_options(component.options, table, component.name))
            check_component(slot, component.name, obj)
            checked += 1
    assert checked >= 15


def test_a_complete_spec_passes():
    check_component("model", "mine", Spec())


class ZeroVocab(Spec):
    vocab_size = 0


class HalfHF(Spec):  # hf export without the config.json it writes: an AttributeError at export, before
    def to_hf_state_dict(self, sd):
        return sd


@pytest.mark.parametrize(
    "slot, obj, words",
    [
        ("model", NoActivationBytes(), ["model plugin 'mine'", "activation_bytes must be a method"]),
        ("model", DictCounts(), ["param_counts() must return (total, non_embedding)", "{'total': 1}"]),
        ("model", WrongArity(), ["flops_per_token must take 1 argument(s)", "it takes 0"]),
        ("model", BadMaxSeq(), ["max_seq_len must be int", "'2048'"]),
        ("model", ZeroVocab(), ["model plugin 'mine': vocab_size must be an int >= 1, got 0"]),
        ("model", HalfHF(), ["model plugin 'mine': to_hf_state_dict needs hf_config too"]),
        ("lr_schedule", NoMultiplier(), ["returned NoMultiplier, which lacks multiplier"]),
        ("precision", StringDtype(), ["param_dtype must be NoneType | dtype", "'bfloat16'"]),
    ],
)
def test_breaches_are_one_line_errors(slot, obj, words):
    with pytest.raises(PluginError) as e:
        check_component(slot, "mine", obj)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_the_contract_is_printed():
    text = describe_contract()
    assert "[model]" in text and "param_counts: method, 0 argument(s), optional" in text


def test_a_data_source_off_by_one_is_refused():
    """sample() must return seq_len + 1 ids (inputs and shifted labels); seq_len ids is one line."""
    import numpy as np

    from core.contract.errors import DataError
    from core.data.indexed import IndexedSource, checked_sample

    class OffByOne(IndexedSource):
        def sample(self, index, seq_len, split):
            return np.arange(seq_len, dtype=np.int64)

    class Right(IndexedSource):
        def sample(self, index, seq_len, split):
            return np.arange(seq_len + 1, dtype=np.int64)

    assert checked_sample(Right(), 0, 16, "train").shape == (17,)
    with pytest.raises(DataError, match=r"OffByOne: sample\(0, seq_len=16, 'train'\) returned ndarray of shape \(16,\)"):
        checked_sample(OffByOne(), 0, 16, "train")
    loader = OffByOne().loader(
        __import__("core.contract.protocols", fromlist=["LoaderSpec"]).LoaderSpec(
            seq_len=16, micro_batch=2, grad_accum=1, dp_rank=0, dp_size=1, seed=0, total_samples=10
        )
    )
    with pytest.raises(DataError, match="expected a 1-D integer array of seq_len \\+ 1 = 17"):
        next(iter(loader))


def test_a_data_source_id_beyond_the_vocabulary_is_refused_on_any_sample():
    """Every sample is checked against the vocabulary the core hands in (LoaderSpec.vocab_size): an id the
    embedding cannot look up is refused in one line (the last id, a label only, may be -100)."""
    import numpy as np

    from core.contract.errors import DataError
    from core.contract.protocols import LoaderSpec
    from core.data.indexed import IndexedSource

    class LateBadId(IndexedSource):
        def sample(self, index, seq_len, split):
            row = np.arange(seq_len + 1, dtype=np.int64)
            row[-1] = -100 if index == 1 else row[-1]
            row[3] = 600 if index == 5 else row[3]
            return row

    source = LateBadId()
    batches = iter(source.loader(LoaderSpec(seq_len=16, micro_batch=2, grad_accum=1, dp_rank=0, dp_size=1, seed=0, vocab_size=512)))
    next(batches), next(batches)  # samples 0-3, the -100 label of sample 1 included
    with pytest.raises(DataError, match=r"LateBadId: sample\(5, seq_len=16, 'train'\) returned token ids from 0 to 600; expected ids in 0..511"):
        next(batches)


def test_plugins_listing_names_the_optional_members_each_component_provides():
    from core.cli.plugins import render

    def block(text: str, name: str) -> str:
        start = text.index(f"  {name}  -- ")
        end = text.find("\n  ", text.index("optional", start))
        return text[start:end]

    data, model, par = render("data"), render("model"), render("parallelism")
    assert block(data, "token_bin").endswith("optional: has_split, tokens_per_epoch, fingerprint, tokenizer, end_of_document_id")
    assert block(data, "synthetic").endswith("optional: has_split")
    # mixture's defaults (no sources) cannot be built: its class says what it provides, and says so
    assert "optional (from its class; default options: ConfigError): has_split, check_resume, metrics" in block(data, "mixture")
    assert "to_hf_state_dict, from_hf_state_dict, hf_config" in block(model, "llama3")
    assert block(par, "ddp").endswith("optional: shards_parameters, wraps_before_compile")
    assert "optional:" not in render("lr_schedule").split("  warmup_cosine  -- ")[1]  # the slot has no optional member


def test_a_member_reads_as_declared_with_its_default():
    """member() is the one reader: an optional value absent, or set to None, reads as its declared
    default; one that is set reads as itself; a name the declaration lacks is never looked up."""
    from types import SimpleNamespace

    from core.contract.members import MADE, member

    declared = {m.name: m.default for m in CONTRACT["parallelism"] + CONTRACT["optimizer"] + CONTRACT["data"]}
    assert declared["shards_parameters"] is False and declared["state_bytes_per_param"] == 8 and declared["samples_before_loader"] is True
    assert member("parallelism", SimpleNamespace(), "shards_parameters") is False
    assert member("parallelism", SimpleNamespace(shards_parameters=None), "shards_parameters") is False
    assert member("parallelism", SimpleNamespace(shards_parameters=True), "shards_parameters") is True
    assert member("optimizer", SimpleNamespace(), "state_bytes_per_param") == 8
    assert member("data", SimpleNamespace(), "samples_before_loader") is True
    assert member("data", SimpleNamespace(), "check_resume") is None
    assert member("loader", SimpleNamespace(may_end=True), "may_end") is True and {m.name for m in MADE["loader"]} >= {"may_end", "per_rank_state"}
    with pytest.raises(KeyError):
        member("data", SimpleNamespace(shards_parameters=True), "shards_parameters")  # declared for parallelism, not data
