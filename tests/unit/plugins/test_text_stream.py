"""The streaming source at the loader level: packing, sharding, shuffle from positions, exact mid-epoch
resume with workers (started from a fork server), positions as snapshots resumed at another seq_len or
buffer, stopping streams, and bad files and shards refused before training."""

from __future__ import annotations

import json

import pytest
import torch
from shared import varied_documents

from core.contract.errors import DataError
from core.contract.protocols import LoaderSpec
from plugins.data.bytes_tokenizer import decode
from plugins.data.text_stream import TextStream, TextStreamOptions


@pytest.fixture
def corpus(tmp_path):
    return varied_documents(tmp_path)


def stream(corpus, **kw):
    s = TextStream(TextStreamOptions(files=[str(corpus)], **kw))
    s.validate(512, 32)
    return s


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_packs_documents_with_eos_in_order(corpus):
    x, y = take(stream(corpus).loader(LoaderSpec(32, 2, 1, 0, 1, 42)), 1)[0]
    assert x.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])
    text = decode(torch.cat([x[0], y[0, -1:]]).tolist())
    assert text.startswith("document 0: lorem ipsum") and 256 in x[0].tolist()


def test_ranks_get_disjoint_documents(corpus):
    import re

    seen = []
    for rank in range(2):
        rows = take(stream(corpus).loader(LoaderSpec(32, 4, 1, rank, 2, 42)), 5)
        text = "".join(decode(torch.cat([x.flatten()]).tolist()) for x, _ in rows)
        seen.append({int(n) for n in re.findall(r"document (\d+):", text)})
    assert seen[0] and seen[1] and seen[0].isdisjoint(seen[1])
    assert all(n % 2 == 0 for n in seen[0]) and all(n % 2 == 1 for n in seen[1])  # shard k takes documents k, k+2, ...


def test_shuffle_comes_from_positions_not_worker_rng(corpus):
    a = take(stream(corpus, shuffle_buffer=8).loader(LoaderSpec(32, 2, 1, 0, 1, 42)), 6)
    torch.manual_seed(123)  # a different global RNG state changes nothing
    b = take(stream(corpus, shuffle_buffer=8).loader(LoaderSpec(32, 2, 1, 0, 1, 42)), 6)
    plain = take(stream(corpus).loader(LoaderSpec(32, 2, 1, 0, 1, 42)), 6)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, plain))


def test_mid_epoch_resume_with_two_workers_gives_identical_batches(corpus):
    spec = LoaderSpec(32, 2, 1, 0, 1, 42)
    straight = take(stream(corpus, workers=2, shuffle_buffer=4).loader(spec), 12)
    first = stream(corpus, workers=2, shuffle_buffer=4).loader(spec)
    it = iter(first)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))  # through JSON, as checkpoints store it
    resumed = stream(corpus, workers=2, shuffle_buffer=4).loader(spec)
    resumed.load_state_dict(state)
    rest = take(resumed, 5)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(straight[7:], rest))


def children(pid: int) -> set[int]:
    import os

    return {int(c) for task in os.listdir(f"/proc/{pid}/task") for c in open(f"/proc/{pid}/task/{task}/children").read().split()}


def blocked_signals(pid: int) -> int:
    return int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("SigBlk:")).split()[1], 16)


def test_workers_start_from_a_fork_server_not_from_the_rank(corpus):
    """Soak (bench/soak.py, two ranks rolling back a few hundred times): a worker forked from the
    multi-threaded rank hung in the fork itself (CPython gh-112275, unfixed in 3.11.7), and the rank waited
    for its batch until the stall watchdog ended the run. Workers start from a single-threaded fork
    server now; it and they ignore the stop signals (SIGHUP, SIGTERM to the process group); and a
    loader given a new position ends its old workers before new ones start (a rollback's
    state_dict() started the new ones beside the old)."""
    import os
    import signal

    from core.data.worker_start import server_pid

    forks: list[int] = []
    os.register_at_fork(before=lambda: forks.append(os.getpid()))
    loader = stream(corpus, workers=2, shuffle_buffer=4).loader(LoaderSpec(32, 2, 1, 0, 1, 42))
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    server = server_pid()
    assert [f for f in forks if f == os.getpid()] == [] and server is not None
    workers = children(server)
    assert len(workers) == 2 and not workers & children(os.getpid())
    stop = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGHUP - 1))
    assert all(blocked_signals(pid) & stop == stop for pid in (server, *workers))
    for sig in (signal.SIGHUP, signal.SIGTERM):  # a closed terminal, SLURM's signal to the whole job
        os.kill(server, sig)
    position = loader.state_dict()  # a rollback: the position kept, the loader given it again
    loader.load_state_dict(position)
    loader.state_dict()  # what the step's fetch asks first: the new workers start here
    assert len(children(server)) == 2 and not children(server) & workers  # the old two ended first
    again = iter(loader)
    assert len(first) == 3 and next(again)[0].shape == (2, 32) and server_pid() == server
    assert [f for f in forks if f == os.getpid()] == []


def test_a_stopping_stream_drains_its_shuffle_buffer(corpus):
    """At the end of the files (on_end = "stop") the windows still held by the shuffle buffer are
    served too: the shuffled stream is a permutation of the plain one, none dropped, and a resume
    from a position inside that drain continues it exactly."""

    def rows(shard):
        return [tuple(t.tolist()) for t in shard]

    plain = rows(stream(corpus, on_end="stop").windows(32, 0, 1, 42))
    shuffled = rows(stream(corpus, on_end="stop", shuffle_buffer=8).windows(32, 0, 1, 42))
    assert len(plain) > 50 and shuffled != plain and sorted(shuffled) == sorted(plain)
    first = stream(corpus, on_end="stop", shuffle_buffer=8).windows(32, 0, 1, 42)
    it = iter(first)
    head = [tuple(next(it).tolist()) for _ in range(len(plain) - 3)]  # inside the drain: 3 of 7 held windows left
    assert first.state["buffer"], "the resume point should lie inside the drain"
    resumed = stream(corpus, on_end="stop", shuffle_buffer=8).windows(32, 0, 1, 42)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + rows(resumed) == shuffled


def test_a_position_saved_at_another_seq_len_or_buffer_resumes_without_loss(corpus):
    """A sequence-length stage hands the stream's saved position to a loader of another length; the
    shuffle buffer then held windows of the old length, and the next batch failed to stack ("stack
    expects each tensor to be equal size"), in the rank or in a worker. They are cut again: every
    token of the stream is served once, at the new length (a smaller buffer serves its surplus)."""
    from collections import Counter

    docs = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    every = Counter(t for d in docs for t in [*d.encode(), 256])  # the bytes tokenizer, EOS after each document
    for seq, buffer in ((16, 8), (40, 8), (32, 2)):
        first = stream(corpus, on_end="stop", shuffle_buffer=8).windows(32, 0, 1, 42)
        it = iter(first)
        head = [next(it).tolist() for _ in range(20)]
        resumed = stream(corpus, on_end="stop", shuffle_buffer=buffer).windows(seq, 0, 1, 42)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        rest = [w.tolist() for w in resumed]
        assert rest and all(len(w) == seq + 1 for w in rest), seq
        served = Counter(t for w in head + rest for t in w)
        assert not served - every and sum((every - served).values()) <= seq, (seq, buffer)  # at most the last, partial window
    spec = LoaderSpec(32, 2, 1, 0, 1, 42)
    loader = stream(corpus, workers=2, shuffle_buffer=4).loader(spec)
    take(loader, 5)
    stage = stream(corpus, workers=2, shuffle_buffer=4).loader(LoaderSpec(16, 4, 1, 0, 1, 42))  # the trainer's switch_stage
    stage.load_state_dict(loader.state_dict())
    assert [tuple(x.shape) for x, _ in take(stage, 4)] == [(4, 16)] * 4


def test_a_stopping_shard_too_small_for_one_window_is_bad_input(tmp_path):
    """on_end = "stop" with files that cannot fill one window: not a run that ends at step 0 with
    exit code 0 and reason data_end, having trained nothing, but a DataError (exit 2 from the
    trainer, as for a bad line found mid-run) naming the shard, its tokens and the window."""
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(4)))  # 4 x 3 tokens
    with pytest.raises(DataError, match=r"shard 0 of 1 holds 12 tokens in all, fewer than one window of data.seq_len \+ 1 = 65"):
        list(stream(path, on_end="stop").windows(64, 0, 1, 42))
    with pytest.raises(DataError, match=r"shard 1 of 2 holds 6 tokens in all, fewer than one window"):
        list(stream(path, on_end="stop").windows(64, 1, 2, 42))  # rank 1's shard
    assert len(list(stream(path, on_end="stop").windows(5, 0, 1, 42))) == 2  # two windows of 6: fine


def test_bad_files(tmp_path):
    with pytest.raises(DataError, match="matches no file"):
        TextStream(TextStreamOptions(files=[str(tmp_path / "*.jsonl")])).validate(512, 32)
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DataError, match="is not .jsonl or .parquet"):
        TextStream(TextStreamOptions(files=[str(tmp_path / "a.txt")])).validate(512, 32)


def test_a_stream_with_a_shard_without_documents_is_refused_before_training(tmp_path):
    """Fewer documents than shards (ranks x workers): the shards without one failed at their first read,
    after the model was built (and, on one rank of two, while the other went on into the step)."""
    from core.contract.errors import DataError
    from plugins.data.mixture import Mixture, MixtureOptions

    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"text": "a single document " * 40}) + "\n")
    stream = TextStream(TextStreamOptions(files=[str(path)]))
    stream.validate(512, 16)
    stream.check_first_step(LoaderSpec(16, 2, 1, 0, 1, 42))
    with pytest.raises(DataError, match=r"holds 1 document\(s\), fewer than its 2 shards \(2 rank\(s\)\), .*: shard 1 \(rank 1\) would have no data"):
        stream.check_first_step(LoaderSpec(16, 2, 1, 0, 2, 42))
    two_workers = TextStream(TextStreamOptions(files=[str(path)], workers=2))
    two_workers.validate(512, 16)
    with pytest.raises(DataError, match=r"fewer than its 2 shards \(1 rank\(s\) x workers = 2\)"):
        two_workers.check_first_step(LoaderSpec(16, 2, 1, 0, 1, 42))
    mix = Mixture(MixtureOptions(sources=[{"name": "text_stream", "weight": 1.0, "files": [str(path)], "label": "qa"}, {"name": "synthetic", "weight": 1.0}]))
    mix.validate(512, 16)
    with pytest.raises(DataError, match=r"\[data\] mixture: source 'qa': .* holds 1 document\(s\), fewer than its 2 shards"):
        mix.check_first_step(LoaderSpec(16, 2, 1, 0, 2, 42))


def test_fingerprint_follows_the_files(corpus):
    def fingerprint(**kw):
        s = TextStream(TextStreamOptions(files=[str(corpus)], **kw))
        assert s.fingerprint() is None  # nothing known before validate
        s.validate(512, 32)
        return s.fingerprint()

    first = fingerprint()
    assert first == fingerprint() and first.startswith("1 file(s), ")
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    assert fingerprint() != first


def test_a_position_is_a_snapshot_that_reading_on_leaves_as_it_is(corpus):
    """The trainer keeps a may_end loader's state_dict() from before each step (core.data.step_batches) and
    saves it if every rank stops there. A state that later reads changed would resume past the step's windows;
    a deep copy, which text_stream made, cost ~8 ms a step with a 64-window buffer (now lists are copied and
    windows, never changed once cut, shared)."""
    import copy

    loader = stream(corpus, shuffle_buffer=8).loader(LoaderSpec(32, 2, 1, 0, 1, 42))
    it = iter(loader)
    for _ in range(3):
        next(it)
    snapshot = loader.state_dict()
    frozen = copy.deepcopy(snapshot)
    after = [next(it) for _ in range(4)]
    assert snapshot == frozen  # reading on left it as it was
    again = stream(corpus, shuffle_buffer=8).loader(LoaderSpec(32, 2, 1, 0, 1, 42))
    again.load_state_dict(snapshot)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(after, take(again, 4)))  # and it resumes there
