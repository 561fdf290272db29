"""Data sources at the loader level (no process group needed): token_bin batches independent of the world
size and resumed at another, the shipped corpus, the synthetic source, mixture weights, stages,
tokenizers and fingerprints, a third-party seq_len schedule checked, and validation parts declared and
their loss a plain float."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO
from shared import write

from core.contract.errors import ConfigError, DataError
from core.contract.protocols import LoaderSpec

CORPUS = REPO / "plugins" / "data" / "corpus" / "shakespeare"


def token_bin(path=CORPUS, **kw):
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    return TokenBin(TokenBinOptions(path=str(path), **kw))


def global_rows(source, steps: int, global_batch: int, dp_size: int, seq_len: int = 32, start: int = 0, seed: int = 42):
    """{global sample index: row} for ``steps`` steps, gathered over every rank's loader."""
    micro = 2
    accum = global_batch // (micro * dp_size)
    rows = {}
    for rank in range(dp_size):
        loader = source.loader(LoaderSpec(seq_len, micro, accum, rank, dp_size, seed))
        if start:
            loader.load_state_dict({"consumed_samples": start})
        it = iter(loader)
        for micro_step in range(steps * accum):
            idx = loader.indices(micro_step)
            x, y = next(it)
            assert x.shape == (micro, seq_len) and y.shape == (micro, seq_len)
            assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
            for i, row in zip(idx, x.numpy()):
                assert i not in rows
                rows[i] = row
    return rows


def test_token_bin_batches_independent_of_world_size():
    src = token_bin()
    src.validate(512, 32)
    ref = global_rows(src, steps=3, global_batch=8, dp_size=1)
    assert sorted(ref) == list(range(24))
    for dp in (2, 4):
        got = global_rows(src, steps=3, global_batch=8, dp_size=dp)
        assert sorted(got) == sorted(ref)
        assert all(np.array_equal(got[i], ref[i]) for i in ref)
    other_seed = global_rows(src, steps=1, global_batch=8, dp_size=1, seed=7)
    assert not all(np.array_equal(other_seed[i], ref[i]) for i in other_seed)


def test_resume_at_other_world_size_continues_global_stream():
    src = token_bin()
    straight = global_rows(src, steps=4, global_batch=8, dp_size=2)
    first = global_rows(src, steps=2, global_batch=8, dp_size=2)
    rest = global_rows(src, steps=2, global_batch=8, dp_size=4, start=16)
    assert sorted(first) + sorted(rest) == list(range(32))  # nothing repeated, nothing skipped
    assert all(np.array_equal({**first, **rest}[i], straight[i]) for i in straight)


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda d: None, "does not exist"),
        (lambda d: (d.mkdir(), (d / "train.bin").write_bytes(b"")), "train.bin is empty"),
        (lambda d: (d.mkdir(), (d / "train.bin").write_bytes(b"\x00" * 301)), "not a multiple of uint16"),
        (lambda d: write(d / "train.bin", list(range(600))), "train.bin holds token id 599, not below the model's vocabulary 512"),
        (lambda d: (write(d / "train.bin", [1] * 100), (d / "meta.json").write_text('{"dtype": "uint32"}')), "meta.json: dtype is uint32"),
        (lambda d: write(d / "train.bin", [1] * 10), "fewer than data.seq_len"),
        (lambda d: (d.mkdir(), (d / "val.bin").write_bytes(b"\x01\x00" * 100)), "train.bin not found"),
    ],
)
def test_token_bin_validate_errors(tmp_path, setup, match):
    d = tmp_path / "data"
    setup(d)
    dtype = "uint16" if "uint32" in match else "auto"
    with pytest.raises(DataError, match=match):
        token_bin(d, dtype=dtype).validate(512, 32)


def test_shipped_corpus_is_english_bytes():
    from plugins.data.bytes_tokenizer import decode

    meta = json.loads((CORPUS / "meta.json").read_text())
    assert meta["vocab_size"] == 257 and meta["tokens"]["train"] > 2_000_000
    src = token_bin()
    src.validate(257, 512)
    text = decode(np.fromfile(CORPUS / "train.bin", dtype=np.uint16)[:20000])
    assert " the " in text and "HAMLET" in text.upper() or "ANTONY" in text.upper()


def test_synthetic_is_deterministic_and_learnable():
    from plugins.data.synthetic import Synthetic, SyntheticOptions

    a, b = Synthetic(SyntheticOptions()), Synthetic(SyntheticOptions())
    for s in (a, b):
        s.validate(100, 16)
    ra = global_rows(a, 2, 4, 1, seq_len=16)
    rb = global_rows(b, 2, 4, 2, seq_len=16)
    assert all(np.array_equal(ra[i], rb[i]) for i in ra)
    row = a.sample(3, 16, "train")
    assert np.array_equal(row[:8], row[9:17]) and row.max() < 100  # 17 tokens: a half of 9, repeated
    with pytest.raises(DataError, match="exceeds the model's vocabulary"):
        Synthetic(SyntheticOptions(vocab_size=1000)).validate(512, 16)


def mixture(weights, **extra):
    from plugins.data.mixture import Mixture, MixtureOptions

    sources = [{"name": "synthetic", "weight": w, "vocab_size": 10 + i} for i, w in enumerate(weights)]
    return Mixture(MixtureOptions(sources=sources, **extra))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_mixture_proportions_match_weights_in_every_window(dp):
    weights = [0.45, 0.25, 0.2, 0.1]
    mix = mixture(weights)
    mix.validate(512, 16)
    rows = global_rows(mix, steps=50, global_batch=16, dp_size=dp, seq_len=16)
    which = mix.choose(np.arange(800))
    # the source of a row is recognisable from its vocabulary bound (10 + i)
    for i, row in rows.items():
        assert row.max() < 10 + which[i]
    for start in range(0, 800, 200):  # every window of 200 samples, not only the total
        share = np.bincount(which[start : start + 200], minlength=4) / 200
        assert np.abs(share - weights).max() <= 0.015, share  # stated tolerance: 1.5 points
    total = mix.counts(800) / 800
    assert np.abs(total - weights).max() <= 0.005
    metrics = mix.metrics(800)
    assert set(metrics) == {"data/0_synthetic_tokens", "data/1_synthetic_tokens", "data/2_synthetic_tokens", "data/3_synthetic_tokens"}


def test_mixture_stages_switch_weights_by_run_fraction():
    from plugins.data.mixture import Mixture, MixtureOptions

    sources = [{"name": "synthetic", "weight": 1, "vocab_size": 10 + i} for i in range(2)]
    mix = Mixture(MixtureOptions(sources=sources, stages=[(0.0, [1.0, 0.0]), (0.5, [0.0, 1.0])]))
    mix.validate(512, 16)
    mix.loader(LoaderSpec(16, 2, 1, 0, 1, 42, total_samples=1000))
    which = mix.choose(np.arange(1000))
    assert (which[:500] == 0).all() and (which[500:] == 1).all()
    with pytest.raises(ConfigError, match="stage at 0.5 gives 1 weights for 2 sources"):
        Mixture(MixtureOptions(sources=sources, stages=[(0.0, [1.0, 0.0]), (0.5, [1.0])]))


def test_a_third_party_seq_len_schedule_is_checked():
    """Any monitor may state the schedule; the core holds what it returns to the hook's contract."""
    from core.api import PluginError, hookimpl
    from core.config.registry import plugin_manager
    from core.contract.hookspecs import register_monitor
    from core.preflight.prepare import seq_len_schedule

    class Schedule:
        def __init__(self, result):
            self.result = result

        @hookimpl
        def plait_seq_len_schedule(self, total_steps):
            return self.result

    class RC:
        seq_len = 128

        class train:
            micro_batch = 2

    def ask(*results):
        pm, names = plugin_manager(), []
        for i, r in enumerate(results):
            register_monitor(pm, f"m{i}", Schedule(r))
            names.append(f"m{i}")
        return seq_len_schedule(pm, names, RC, 10, "run.toml")

    assert ask(None) == []
    assert ask(None, [(0, 64), (5, 256)], [(0, 32)]) == [(0, 64), (5, 256)]  # the first in config order wins
    with pytest.raises(PluginError, match=r"monitor 'm0': sequence-length schedule: first steps must rise within 0..10; got \[5, 5\]"):
        ask([(5, 64), (5, 128)])
    with pytest.raises(PluginError, match="expected a list of \\(first_step, seq_len\\) integer pairs"):
        ask([(0.5, 64)])


def test_mixture_bad_weights_and_names():
    with pytest.raises(ConfigError, match="weights are all zero"):
        mixture([0, 0])
    with pytest.raises(ConfigError, match=r"sources\[1\].weight: expected a finite number >= 0, got -1"):
        mixture([1, -1])
    from plugins.data.mixture import Mixture, MixtureOptions

    with pytest.raises(ConfigError, match="no data plugin named 'tokenbin'.*did you mean 'token_bin'"):
        Mixture(MixtureOptions(sources=[{"name": "tokenbin", "weight": 1}]))
    with pytest.raises(ConfigError, match=r"sources\[0\].on_exhausted: expected \"wrap\" or \"stop\", got 'loop'"):
        Mixture(MixtureOptions(sources=[{"name": "synthetic", "weight": 1, "on_exhausted": "loop"}]))
    with pytest.raises(ConfigError, match=r"sources\[1\].label: 'web' is already the label of another source"):
        Mixture(MixtureOptions(sources=[{"name": "synthetic", "weight": 1, "label": "web"}, {"name": "synthetic", "weight": 1, "label": "web"}]))
    with pytest.raises(ConfigError, match=r"sources\[0\].label: expected a non-empty string .*, got 5"):
        Mixture(MixtureOptions(sources=[{"name": "synthetic", "weight": 1, "label": 5}, {"name": "synthetic", "weight": 1}]))
    with pytest.raises(ConfigError, match=r"sources\[0\].weight: expected a finite number >= 0, got inf"):
        Mixture(MixtureOptions(sources=[{"name": "synthetic", "weight": float("inf")}, {"name": "synthetic", "weight": 1}]))
    # weights near the largest float: their sum overflowed to inf, and every share became 0
    huge = Mixture(MixtureOptions(sources=[{"name": "synthetic", "weight": 1e308}, {"name": "synthetic", "weight": 3e307}]))
    assert huge.weights == pytest.approx([1 / 1.3, 0.3 / 1.3])


def test_mixture_refuses_sources_of_different_tokenizers(tmp_path):
    import shutil

    from plugins.data.mixture import Mixture, MixtureOptions

    def prepared(name, fingerprint):
        d = tmp_path / name
        shutil.copytree(CORPUS, d)
        meta = json.loads((d / "meta.json").read_text())
        (d / "meta.json").write_text(json.dumps({**meta, "tokenizer_fingerprint": fingerprint}))
        return str(d)

    a, b, c = prepared("a", "a" * 64), prepared("b", "a" * 64), prepared("c", "c" * 64)
    Mixture(MixtureOptions(sources=[{"name": "token_bin", "weight": 1, "path": a}, {"name": "token_bin", "weight": 1, "path": b}])).validate(512, 32)
    mixed = Mixture(MixtureOptions(sources=[{"name": "token_bin", "weight": 1, "path": a}, {"name": "token_bin", "weight": 1, "path": c}]))
    with pytest.raises(DataError, match="prepared with different tokenizers"):
        mixed.validate(512, 32)


def test_mixture_with_a_stream_refuses_a_resume_at_another_world_size(tmp_path):
    from plugins.data.mixture import Mixture, MixtureOptions

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(50)))
    mixture = Mixture(
        MixtureOptions(
            sources=[{"name": "token_bin", "weight": 1, "path": str(CORPUS)}, {"name": "text_stream", "weight": 1, "files": [str(docs)], "label": "qa"}]
        )
    )
    mixture.check_resume({"world_size": 2}, 2)
    with pytest.raises(DataError, match="stream source\\(s\\) qa saved their positions on 2 ranks, this run has 1"):
        mixture.check_resume({"world_size": 2}, 1)


def test_validation_parts_are_declared_and_checked():
    from core.contract.errors import PluginError
    from core.contract.members import CONTRACT
    from core.contract.protocols import validation_parts

    member = {m.name: m for m in CONTRACT["data"]}["validation_loaders"]
    assert member.kind == "method" and member.params == 1 and not member.required
    spec = LoaderSpec(32, 2, 1, 0, 1, 42, split="val")
    assert validation_parts(token_bin(), spec) == {}  # a source without parts: val_loss only

    class BadParts:
        def validation_loaders(self, spec):
            return [("a", None)]

    with pytest.raises(PluginError, match="validation_loaders.*must return"):
        validation_parts(BadParts(), spec)


def test_validation_loss_is_a_plain_float_to_checkpoints_and_monitors():
    import math
    import pickle

    from core.loop.validation import ValidationLoss

    loss = ValidationLoss(1.25, {"val_loss/web": 1.5})
    best = min(math.inf, loss)  # what the trainer keeps in the train state
    assert json.loads(json.dumps({"val_loss": loss, "best_val_loss": best})) == {"val_loss": 1.25, "best_val_loss": 1.25}
    assert type(pickle.loads(pickle.dumps(loss))) is float and loss.parts == {"val_loss/web": 1.5}
    assert ValidationLoss(2.0).parts == {}


def test_mixture_fingerprint_combines_its_sources_and_weights():
    from conftest import REPO

    from plugins.data.mixture import Mixture, MixtureOptions

    corpus = str(REPO / "plugins" / "data" / "corpus" / "shakespeare")

    def fingerprint(w, second="token_bin"):
        extra = {"path": corpus} if second == "token_bin" else {}
        sources = [{"name": "token_bin", "label": "a", "weight": w, "path": corpus}, {"name": second, "label": "b", "weight": 1 - w, **extra}]
        return Mixture(MixtureOptions(sources=sources)).fingerprint()

    first = fingerprint(0.5)
    assert first is not None and first.startswith("mixture ") and first == fingerprint(0.5)
    assert fingerprint(0.7) != first  # other weights: another mixture of the same files
    assert fingerprint(0.5, second="synthetic") is None  # a source without a fingerprint: none for the mixture
