"""Finite sources at the loader level: epochs in token_bin, a mixture source that runs out (wrap or stop
at the same step on every rank), streams inside a mixture, a validation loader that never stops, and
mixture stages resumed with another run length."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO

from core.contract.protocols import LoaderSpec
from core.data.indexed import DataExhausted

CORPUS = REPO / "plugins" / "data" / "corpus" / "shakespeare"


def write_bin(path, ids):
    path.mkdir(parents=True, exist_ok=True)
    np.asarray(ids, dtype=np.uint16).tofile(path / "train.bin")
    return path


def mixture(sources, **kw):
    from plugins.data.mixture import Mixture, MixtureOptions

    mix = Mixture(MixtureOptions(sources=sources, **kw))
    mix.validate(512, 16)
    return mix


def run_steps(mix, steps, dp_size=1, rank=0, micro=2, accum=2, start=None, seq_len=16):
    """Rows of ``steps`` steps from one rank's loader; also the loader (for its state)."""
    loader = mix.loader(LoaderSpec(seq_len, micro, accum, rank, dp_size, 42))
    if start is not None:
        loader.load_state_dict(start)
    it = iter(loader)
    rows = [next(it)[0].numpy() for _ in range(steps * accum)]
    return rows, loader


def test_token_bin_epochs_visit_every_window_once_per_epoch(tmp_path):
    from plugins.data.token_bin import TokenBin, TokenBinOptions

    d = write_bin(tmp_path / "d", np.arange(16 * 50 + 1))
    src = TokenBin(TokenBinOptions(path=str(d), order="epochs"))
    src.validate(1024, 16)
    src.seed = 3
    n = src.epoch_samples(16, "train")
    assert n == 50
    starts = [int(src.sample(j, 16, "train")[0]) for j in range(2 * n)]
    assert sorted(starts[:n]) == [16 * k for k in range(n)]  # each window exactly once
    assert sorted(starts[n:]) == sorted(starts[:n]) and starts[n:] != starts[:n]  # epoch 2: reshuffled
    row = src.sample(0, 16, "train")
    assert len(row) == 17 and np.array_equal(row, np.arange(row[0], row[0] + 17))
    assert TokenBin(TokenBinOptions(path=str(d))).epoch_samples(16, "train") is None  # random order never ends


def test_mixture_serves_local_indices_so_a_finite_source_is_read_without_repeats(tmp_path):
    d = write_bin(tmp_path / "d", np.arange(16 * 40 + 1) % 500)
    mix = mixture([{"name": "token_bin", "weight": 0.5, "path": str(d), "order": "epochs"}, {"name": "synthetic", "weight": 0.5, "vocab_size": 10}])
    rows, _ = run_steps(mix, steps=10, micro=4, accum=2)  # 80 samples, about 40 from the finite source
    windows = [int(r[0]) for batch in rows for r in batch if r.max() >= 10]
    assert len(windows) == int(mix.counts(80)[0])
    assert len(set(windows)) == len(windows)  # no window twice inside the first epoch


def test_mixture_wraps_an_exhausted_source_with_a_warning_and_counts_epochs(tmp_path, capsys):
    d = write_bin(tmp_path / "d", np.arange(16 * 10 + 1) % 500)  # 10 windows
    mix = mixture(
        [
            {"name": "token_bin", "weight": 0.5, "path": str(d), "order": "epochs", "label": "small"},
            {"name": "synthetic", "weight": 0.5, "vocab_size": 10, "label": "big"},
        ]
    )
    run_steps(mix, steps=8)  # 32 samples, about 16 from "small": one wrap
    err = capsys.readouterr().err
    assert err.count("mixture source 'small' ran out after 10 samples; wrapping into epoch 2") == 1
    metrics = mix.metrics(32)
    assert 1.0 < metrics["data/small_epochs"] < 2.0 and "data/big_epochs" not in metrics


def test_mixture_stop_ends_every_rank_at_the_same_step(tmp_path):
    d = write_bin(tmp_path / "d", np.arange(16 * 10 + 1) % 500)
    sources = [{"name": "token_bin", "weight": 0.5, "path": str(d), "order": "epochs"}, {"name": "synthetic", "weight": 0.5, "vocab_size": 10}]
    ends = []
    for rank in range(2):
        mix = mixture(sources, on_exhausted="stop")
        it = iter(mix.loader(LoaderSpec(16, 2, 2, rank, 2, 42)))
        served = 0
        with pytest.raises(DataExhausted, match="source '0_token_bin' ran out after 10 samples"):
            while True:
                next(it)
                served += 1
        ends.append(served)
    assert ends[0] == ends[1] and ends[0] % 2 == 0 and ends[0] > 0  # whole steps, the same on both ranks
    steps = ends[0] // 2
    used = mixture(sources).counts(steps * 8)[0]
    assert used <= 10 < mixture(sources).counts((steps + 1) * 8)[0]  # it stopped at the first step that would overrun


def stream_corpus(tmp_path, docs=60):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": "z" * 40 + f" doc {i}"}) + "\n" for i in range(docs)))
    return path


def test_mixture_holds_a_stream_with_exact_proportions_and_resume(tmp_path):
    corpus = stream_corpus(tmp_path)
    sources = [
        {"name": "text_stream", "weight": 0.3, "files": [str(corpus)], "label": "qa"},
        {"name": "synthetic", "weight": 0.7, "vocab_size": 10, "label": "web"},
    ]
    mix = mixture(sources)
    straight, _ = run_steps(mix, steps=6)
    flat = np.concatenate(straight)
    from_stream = (flat.max(axis=1) >= 10).sum()
    assert from_stream == mix.counts(24)[0]  # the rows from the stream are exactly the mixture's picks
    assert 256 in flat  # EOS between the stream's documents

    first, loader = run_steps(mixture(sources), steps=3)
    state = json.loads(json.dumps(loader.state_dict()))  # what a checkpoint stores, per rank
    assert "qa" in state["streams"] and loader.per_rank_state
    rest, _ = run_steps(mixture(sources), steps=3, start=state)
    assert all(np.array_equal(a, b) for a, b in zip(first + rest, straight))


def test_stream_inside_mixture_that_ends_raises_data_exhausted(tmp_path):
    corpus = stream_corpus(tmp_path, docs=4)
    mix = mixture([{"name": "text_stream", "weight": 0.5, "files": [str(corpus)], "on_end": "stop"}, {"name": "synthetic", "weight": 0.5, "vocab_size": 10}])
    loader = mix.loader(LoaderSpec(16, 2, 1, 0, 1, 42))
    assert loader.may_end
    it = iter(loader)
    with pytest.raises(DataExhausted, match="stream '0_text_stream' reached the end of its files"):
        for _ in range(100):
            next(it)


def test_validation_loader_never_stops_on_exhaustion(tmp_path):
    d = write_bin(tmp_path / "d", np.arange(16 * 10 + 1) % 500)
    np.asarray(np.arange(16 * 4 + 1) % 500, dtype=np.uint16).tofile(d / "val.bin")  # 4 windows
    mix = mixture([{"name": "token_bin", "weight": 1.0, "path": str(d), "order": "epochs"}], on_exhausted="stop")
    it = iter(mix.loader(LoaderSpec(16, 2, 1, 0, 1, 42, split="val")))
    for _ in range(10):  # 20 samples from a 4-window split: wraps, the run is not stopped by validation
        x, _ = next(it)
        assert x.shape == (2, 16)


def test_a_stopping_source_without_data_for_the_first_step_is_bad_input(tmp_path):
    """A source that stops the run when it runs out, with data for a window but not for the first
    step: not a run that ends at step 0 with exit code 0 (reason data_end), having trained
    nothing. ``check_first_step`` (run by preflight, so by core.train and core.plan) refuses it
    with one line naming the source, its file, what it holds and what the first step takes."""
    from core.contract.errors import DataError
    from plugins.data.text_stream import TextStream, TextStreamOptions

    d = write_bin(tmp_path / "d", np.arange(16 * 10 + 1) % 500)  # 10 windows of 16
    only = [{"name": "token_bin", "weight": 1.0, "path": str(d), "order": "epochs", "on_exhausted": "stop"}]
    mixture(only).check_first_step(LoaderSpec(16, 5, 1, 0, 2, 42))  # exactly one step: fine
    with pytest.raises(
        DataError, match=r"source '0_token_bin' \(.*train.bin\) holds 10 sample\(s\) of data.seq_len 16 \(one epoch\); the first step takes 12 of them"
    ):
        mixture(only).check_first_step(LoaderSpec(16, 3, 2, 0, 2, 42))
    mixture([dict(only[0], on_exhausted="wrap")]).check_first_step(LoaderSpec(16, 3, 2, 0, 2, 42))  # it wraps: never ends

    corpus = stream_corpus(tmp_path, docs=3)  # 47 tokens a document: shard 0 of 2 holds 5 windows of 17, shard 1 holds 2

    def stream(**kw):
        s = TextStream(TextStreamOptions(files=[str(corpus)], on_end="stop", **kw))
        s.validate(512, 16)
        return s

    stream().check_first_step(LoaderSpec(16, 2, 1, 0, 2, 42))
    with pytest.raises(
        DataError, match=r"docs.jsonl holds 2 window\(s\) of data.seq_len \+ 1 = 17 tokens for rank 1 of 2 .* needs train.micro_batch 3 x accumulation 1 = 3"
    ):
        stream().check_first_step(LoaderSpec(16, 3, 1, 0, 2, 42))
    stream(workers=2).check_first_step(LoaderSpec(16, 2, 2, 0, 1, 42))  # workers serve whole micro-batches: 2 + 1
    with pytest.raises(DataError, match=r"holds 7 window\(s\) .* for rank 0 of 1 \(workers = 2\)"):
        stream(workers=2).check_first_step(LoaderSpec(16, 3, 2, 0, 1, 42))  # 7 windows, but 1 + 0 micro-batches of 3
    TextStream(TextStreamOptions(files=[str(corpus)])).check_first_step(LoaderSpec(16, 3, 1, 0, 2, 42))  # wraps: never ends

    inside = [
        {"name": "text_stream", "weight": 0.5, "files": [str(corpus)], "on_end": "stop", "label": "qa"},
        {"name": "synthetic", "weight": 0.5, "vocab_size": 10},
    ]
    mixture(inside).check_first_step(LoaderSpec(16, 2, 1, 0, 2, 42))
    with pytest.raises(
        DataError, match=r"source 'qa' \(.*docs.jsonl\) holds 2 window\(s\) of data.seq_len \+ 1 = 17 tokens for rank 1; the first step takes \d on that rank"
    ):
        mixture(inside).check_first_step(LoaderSpec(16, 8, 1, 0, 2, 42))


@pytest.mark.parametrize("first_total, then_total", [(64, 128), (128, 64)], ids=["longer", "shorter"])
def test_mixture_stages_resumed_with_another_run_length_keep_the_samples_consumed(tmp_path, capsys, first_total, then_total):
    """Stage boundaries recomputed from the run's length on every start would move, on a resume with
    another train.steps, over samples already consumed, and a finite source's windows would be served
    twice or never. The boundaries are fixed in samples and saved in the loader's state: one reached stays, one ahead moves to its fraction of the new length but never before
    the resume point, and a warning names the move."""
    from plugins.data.mixture import Mixture, MixtureOptions

    d = write_bin(tmp_path / "d", np.arange(16 * 200 + 1))  # 200 windows; window w starts with token 16 w
    sources = [{"name": "token_bin", "weight": 1, "path": str(d), "order": "epochs"}, {"name": "synthetic", "weight": 1, "vocab_size": 10}]
    stages = [(0.0, [0.8, 0.2]), (0.25, [0.2, 0.8])]  # the boundary: sample 16 of 64, 32 of 128

    def loader(total):
        mix = Mixture(MixtureOptions(sources=sources, stages=stages))
        mix.validate(4096, 16)
        return mix, mix.loader(LoaderSpec(16, 2, 2, 0, 1, 42, total_samples=total))

    def rows(ld, steps):
        it = iter(ld)
        return [row for _ in range(steps * 2) for row in next(it)[0].numpy()]

    _, first = loader(first_total)
    served = rows(first, 6)  # 24 samples: past the boundary of a 64-sample run, before that of a 128-sample one
    state = json.loads(json.dumps(first.state_dict()))
    assert state["stage_starts"] == [0, first_total // 4] and state["stage_run_samples"] == first_total
    mix, again = loader(first_total)
    again.load_state_dict(state)  # the same length: the same starts, nothing said
    assert mix.stage_bounds.tolist() == [0, first_total // 4] and "stage" not in capsys.readouterr().err
    mix, then = loader(then_total)
    then.load_state_dict(state)
    kept = first_total // 4 if first_total // 4 <= 24 else max(then_total // 4, 24)
    assert mix.stage_bounds.tolist() == [0, kept]
    said = f"{first_total} -> {then_total} samples): the stages begun by sample 24 keep their starts, those ahead follow the new length: stages start at samples [0, {kept}] (the checkpoint's [0, {first_total // 4}]; a fresh run of this length: [0, {then_total // 4}])"
    err = capsys.readouterr().err
    assert said in err, err
    resumed = json.loads(json.dumps(then.state_dict()))
    mix, later = loader(then_total)
    later.load_state_dict(resumed)  # a restart of the resumed run (its length since): the starts it used, nothing said
    assert mix.stage_bounds.tolist() == [0, kept] and "stage" not in capsys.readouterr().err
    served += rows(then, 10)
    from_file = [int(r[0]) // 16 for r in served if r.max() >= 10]  # the token_bin windows served, in order
    expected = [int(mix.sources[0].sample(j, 16, "train")[0]) // 16 for j in range(len(from_file))]
    assert from_file == expected  # its local samples 0, 1, 2, ... each once: nothing repeated or skipped
    picks = mix.choose(np.arange(24, 64))
    assert picks.tolist() == [int(r.max() >= 10) ^ 1 for r in served[24:]]  # the picks after the resume follow the bounds kept


def test_a_mixture_with_stages_starts(tiny_config, tmp_path, capsys):
    """Every start of a mixture with ``stages`` (core.train and core.plan alike) failed with "stages
    need the run's length (train.steps or target_tokens)" however the length was given: the check of
    the first sample before any loader asked which source serves it, which with stages depends on
    the run's length that only a loader's spec brings. Such a mixture says so
    (``samples_before_loader``) and its first step is checked with the run's length."""
    from core.cli.plan import main

    sources = f'[{{name = "token_bin", weight = 1.0, path = "{CORPUS}"}}, {{name = "synthetic", weight = 1.0}}]'
    staged = ["--data.name=mixture", f"--data.sources={sources}", "--data.stages=[[0.0, [1.0, 0.0]], [0.5, [0.0, 1.0]]]"]
    assert main(["--config", str(tiny_config()), f"--train.output_dir={tmp_path / 'plan'}", *staged]) == 0, capsys.readouterr().err
    assert "stages need the run's length" not in capsys.readouterr().err
