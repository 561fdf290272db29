"""The streaming source: packing, sharding, shuffle from positions, exact mid-epoch resume with workers."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, env, read_metrics, run_module

from core.contract.errors import DataError
from core.contract.protocols import LoaderSpec
from plugins.data.bytes_tokenizer import decode
from plugins.data.text_stream import TextStream, TextStreamOptions


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum " * (i % 7 + 1)}) + "\n" for i in range(200)))
    return path


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


@pytest.mark.slow
def test_trains_and_resumes_exactly(corpus, tmp_path):
    cfg = tmp_path / "stream.toml"
    cfg.write_text(f'''
extends = "{REPO / "train_configs" / "base.toml"}"
[train]
steps = 6
global_batch_tokens = 256
micro_batch = 2
log_every = 1
device = "cpu"
[model]
name = "llama3"
flavor = "debug"
dim = 64
[data]
name = "text_stream"
seq_len = 64
files = ["{corpus}"]
workers = 2
shuffle_buffer = 4
[monitors]
enabled = ["jsonl"]
''')
    straight = tmp_path / "straight"
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={straight}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]  # the workers' queues are released at the end (fork server)
    out = tmp_path / "resumed"
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={out}", "--checkpoint.every=3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    import shutil

    shutil.rmtree(out / "checkpoints" / "step_000000006")
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={out}")
    assert proc.returncode == 0 and "at step 3" in proc.stdout, proc.stderr[-2000:]
    a = {r["step"]: r["loss"] for r in read_metrics(straight)}
    b = {r["step"]: r["loss"] for r in read_metrics(out)}
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]


@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.bench), 2])  # 0 workers: also the two-rank test below
def test_a_bad_line_found_mid_run_stops_with_a_checkpoint_and_exit_2(tiny_config, tmp_path, workers):
    """Only the first documents of each file are checked at start; a bad line later must not lose
    the run's work: every rank stops at a step boundary with a checkpoint, exit 2, naming file:line
    in one line (from a loader worker too, where torch wraps it in "Caught DataError in DataLoader
    worker process 0" and the worker's traceback, which the run printed and recorded as it was)."""
    good = "".join(json.dumps({"text": f"document {i}: " + "lorem ipsum " * 9}) + "\n" for i in range(400))
    path = tmp_path / "docs.jsonl"
    path.write_text(good + "{not json\n" + good)
    base = tiny_config(steps=200)
    cfg = tmp_path / "stream.toml"
    cfg.write_text(f'extends = "{base}"\n[data]\nname = "text_stream"\nfiles = ["{path}"]\n')  # switches plugin: path goes
    r = run_module("core.train", "--config", str(cfg), "--checkpoint.every=0", f"--data.workers={workers}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"{path}:401" in r.stderr and "Caught DataError" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    status = json.loads((tmp_path / "out" / "exit_status.json").read_text())
    assert status["exit_code"] == 2 and status["step"] > 0
    assert "\n" not in status["detail"] and status["detail"].startswith(f"bad data: {path}:401"), status["detail"]
    assert (tmp_path / "out" / "checkpoints" / f"step_{status['step']:09d}" / "COMMITTED").is_file()


def test_a_bad_line_on_one_rank_stops_both_ranks_together(tiny_config, tmp_path):
    """Each rank meets a bad line when its own reading reaches it. Rank 1's documents here are short,
    so it reads past line 201 steps before rank 0 does: it stopped to save while rank 0 went on into
    the step's all-reduce, and both hung until the stall watchdog (by default 1800 s x 3 at the first
    step) ended the run as "stalled", which launchers restart onto the same line. A stream's loader
    now makes the ranks agree on each step's data before any compute, whether it stops or wraps, and
    every rank's saved position is from before the step that did not run."""
    from conftest import torchrun

    docs = [json.dumps({"text": f"document {i}: " + ("lorem ipsum " * 60 if i % 2 == 0 else "short")}) for i in range(400)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(docs[:200] + ["{not json"] + docs[200:]) + "\n")
    base = tiny_config(steps=200)
    cfg = tmp_path / "stream.toml"
    cfg.write_text(f'extends = "{base}"\n[data]\nname = "text_stream"\nfiles = ["{path}"]\n')
    r = torchrun(2, "--config", str(cfg), "--checkpoint.every=0", "--train.stall_timeout_s=10", timeout=300)
    status = json.loads((tmp_path / "out" / "exit_status.json").read_text())
    assert r.returncode != 0 and status["exit_code"] == 2, (status, r.stderr[-3000:])
    assert f"rank 1: bad data: {path}:201" in r.stderr and "rank 0: bad data" not in r.stderr
    ckpt = tmp_path / "out" / "checkpoints" / f"step_{status['step']:09d}"
    assert (ckpt / "COMMITTED").is_file()
    # Each rank's saved position is the one after the checkpoint's step: rank 0 had already read its
    # batches of the step that never ran, and skipped them on resume.
    import tomllib

    train = tomllib.loads((tmp_path / "out" / "config.resolved.toml").read_text())["train"]
    seq_len = tomllib.loads((tmp_path / "out" / "config.resolved.toml").read_text())["data"]["seq_len"]
    accum = train["global_batch_tokens"] // (train["micro_batch"] * seq_len * 2)
    for rank in (0, 1):
        position = json.loads((ckpt / "rng" / f"data_rank_{rank}.json").read_text())["stream"]
        assert position["_num_yielded"] == status["step"] * accum, (rank, position["_num_yielded"], status["step"], accum)


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


def test_a_killed_rank_leaves_no_worker_or_fork_server_behind(corpus, tmp_path):
    """A rank killed without ending its workers (SIGKILL, the OOM killer): its fork server and workers
    end within seconds. Each worker held a copy of the server's keep-alive pipe, so the server
    waited for the workers and the workers (watching their parent, the server) for it, for good."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "rank.py"
    script.write_text(
        f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
if __name__ == "__main__":
    from core.contract.protocols import LoaderSpec
    from core.data.worker_start import server_pid
    from plugins.data.text_stream import TextStream, TextStreamOptions
    s = TextStream(TextStreamOptions(files=[{str(corpus)!r}], workers=2))
    s.validate(512, 32)
    it = iter(s.loader(LoaderSpec(32, 2, 1, 0, 1, 42)))
    next(it)
    server = server_pid()
    kids = open(f"/proc/{{server}}/task/{{server}}/children").read().split()
    print(server, *kids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""
    )
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as o, err.open("w") as e:  # files, not pipes: processes left behind would hold a pipe open
        r = subprocess.run([sys.executable, str(script)], stdout=o, stderr=e, timeout=120)
    pids = [int(p) for p in out.read_text().split()]
    assert r.returncode == -9 and len(pids) == 3, err.read_text()[-2000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2] for p in pids):
        time.sleep(0.5)
    left = [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
    for p in left:  # do not leave them behind on a failure either
        os.kill(p, 9)
    assert not left, f"still running 30 s after their rank was killed: {left} (fork server first)"


def test_workers_under_a_long_tmpdir_start_and_a_run_leaves_nothing_in_tmpdir(corpus, tmp_path):
    """The fork server's socket lives in ``<TMPDIR>/pymp-XXXXXXXX/``: under a TMPDIR too long for a
    socket's path (a scheduler's job folder deep in a scratch file system; ``OSError: AF_UNIX path
    too long``) the run starts, its socket in a short temporary folder. The rank ends with os._exit,
    which skips multiprocessing's removal of the ``pymp-`` folder: a clean end removes it. With no temporary folder at all the
    fork server's failure is one line, exit 2."""
    import subprocess
    import sys

    cfg = tmp_path / "stream.toml"
    cfg.write_text(f'''
extends = "{REPO / "train_configs" / "base.toml"}"
[train]
steps = 2
global_batch_tokens = 128
micro_batch = 2
device = "cpu"
[model]
name = "llama3"
flavor = "debug"
dim = 64
[data]
name = "text_stream"
seq_len = 32
files = ["{corpus}"]
workers = 1
[monitors]
enabled = []
''')
    short, long = tmp_path / "tmp", tmp_path / ("t" * 100)
    for tmpdir in (short, long):
        tmpdir.mkdir()
        r = run_module("core.train", "--config", str(cfg), f"--train.output_dir={tmp_path / ('out_' + tmpdir.name[:8])}", extra_env={"TMPDIR": str(tmpdir)})
        assert r.returncode == 0, r.stderr[-2000:]
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
        assert not list(tmpdir.glob("pymp-*")), list(tmpdir.iterdir())
    no_short_folder = (  # no short folder to be found: the socket would go in the long TMPDIR itself
        "import sys\nfrom core.data import worker_start\nworker_start._socket_folder = lambda: None\n"
        "try:\n    worker_start.worker_context()\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    r = subprocess.run([sys.executable, "-c", no_short_folder], cwd=REPO, env=env(TMPDIR=str(long)), capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("DataError data loader workers cannot start: their fork server's socket in a temporary folder (TMPDIR="), r.stdout + r.stderr
    assert "AF_UNIX path too long" in r.stdout and "set TMPDIR to a short folder this user can write, or data.workers = 0" in r.stdout
