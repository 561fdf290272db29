"""The tokenization command: round trips, idempotence, parquet, bad input."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import REPO, run_module

DOCS = ["Shall I compare thee to a summer's day?", "Thou art more lovely and more temperate:", "Rough winds do shake — ünïcödé"]


def prepare(*args):
    return run_module("plugins.data.prepare", *args, "--workers", "2", timeout=120)


def split_docs(ids: np.ndarray, eos: int) -> list[np.ndarray]:
    cuts = np.flatnonzero(ids == eos)
    return [ids[a + 1 if i else 0 : b] for i, (a, b) in enumerate(zip(np.r_[-1, cuts[:-1]], cuts))]


def test_bytes_round_trip_and_idempotent(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    for i, d in enumerate(DOCS):
        (src / f"{i}.txt").write_text(d)
    out = tmp_path / "out"
    proc = prepare("--input", str(src), "--out", str(out), "--val-fraction", "0")
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stderr
    ids = np.fromfile(out / "train.bin", dtype=np.uint16)
    from plugins.data.bytes_tokenizer import decode

    assert [decode(d) for d in split_docs(ids, 256)] == DOCS
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 3 and meta["tokens"]["train"] == len(ids) and meta["dtype"] == "uint16"
    before = (out / "train.bin").stat().st_mtime_ns
    again = prepare("--input", str(src), "--out", str(out), "--val-fraction", "0")
    assert again.returncode == 0 and "nothing to do" in again.stderr
    assert (out / "train.bin").stat().st_mtime_ns == before


def test_hf_tokenizer_round_trip_jsonl_and_parquet(tmp_path):
    pytest.importorskip("tokenizers", reason="tokenizers is in the dev extra")
    pa = pytest.importorskip("pyarrow", reason="pyarrow is in the dev extra")
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        DOCS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:2]))
    pq.write_table(pa.table({"text": DOCS[2:]}), tmp_path / "more.parquet")
    out = tmp_path / "out"
    proc = prepare(
        "--input",
        str(tmp_path / "docs.jsonl"),
        str(tmp_path / "more.parquet"),
        "--out",
        str(out),
        "--tokenizer",
        f"hf:{tmp_path / 'tokenizer.json'}",
        "--val-fraction",
        "0",
    )
    assert proc.returncode == 0, proc.stderr
    eos = tok.token_to_id("<|endoftext|>")
    ids = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert [tok.decode(d.tolist()) for d in split_docs(ids, eos)] == DOCS


def test_val_fraction_splits_by_document(tmp_path):
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(400)))
    out = tmp_path / "out"
    assert prepare("--input", str(src), "--out", str(out), "--val-fraction", "0.1").returncode == 0
    meta = json.loads((out / "meta.json").read_text())
    val_docs = int((np.fromfile(out / "val.bin", dtype=np.uint16) == 256).sum())
    assert 20 <= val_docs <= 60 and meta["documents"] == 400


def test_val_split_does_not_depend_on_how_the_input_path_is_spelled(tmp_path):
    """The split hashes each file's name from its input folder, not the path as typed: preparing the
    same folder by a relative path, an absolute one and from another working directory gives the
    same train.bin and val.bin (the split hashes the path from the input folder, not as given)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 3}) + "\n" for i in range(200)))
    outs = [tmp_path / f"out{k}" for k in range(3)]
    spellings = [(str(corpus), tmp_path), ("corpus/", tmp_path), ("./a.jsonl", corpus)]
    for (spelled, cwd), out in zip(spellings, outs):
        args = ("--input", spelled, "--out", str(out), "--val-fraction", "0.2", "--workers", "1")
        proc = run_module("plugins.data.prepare", *args, cwd=cwd, extra_env={"PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr
    val = [(out / "val.bin").read_bytes() for out in outs]
    assert len(val[0]) > 0 and val[0] == val[1] == val[2]
    assert (outs[0] / "train.bin").read_bytes() == (outs[1] / "train.bin").read_bytes() == (outs[2] / "train.bin").read_bytes()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: None, "no such file or folder"),
        (lambda d: (d.mkdir(), (d / "a.txt").write_text("")), "empty input"),
        (lambda d: (d.mkdir(), (d / "a.jsonl").write_text("{oops\n")), "a.jsonl:1: not a JSON object"),
        (lambda d: (d.mkdir(), (d / "a.txt").write_bytes(b"\xff\xfe\xfa")), "unreadable"),
    ],
)
def test_bad_input(tmp_path, make, match):
    d = tmp_path / "in"
    make(d)
    proc = prepare("--input", str(d), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and match in proc.stderr, proc.stderr


def test_dtype_too_small_for_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    ranks = tmp_path / "big.tiktoken"
    import base64

    ranks.write_text("\n".join(f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256)))
    proc = prepare(
        "--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), "--tokenizer", f"tiktoken:{ranks}", "--eos-id", "70000", "--dtype", "uint16"
    )
    assert proc.returncode == 2 and "more than uint16 holds" in proc.stderr


def corpus(tmp_path, docs: int = 600):
    """Three files of three kinds: a jsonl (with a blank line and an empty text), a txt and a parquet if pyarrow is here."""
    src = tmp_path / "in"
    src.mkdir()
    lines = [json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 17 + 1)}) for i in range(docs)]
    lines[10], lines[20] = "", json.dumps({"text": ""})
    (src / "a.jsonl").write_text("\n".join(lines) + "\n")
    (src / "b.txt").write_text("a whole file is one document ü\n" * 50)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(
            pa.table({"id": list(range(300)), "text": [f"row {i} " * (i % 5 + 1) if i % 7 else None for i in range(300)]}), src / "c.parquet", row_group_size=64
        )
    except ImportError:
        pass
    return src


def test_output_is_byte_identical_for_any_worker_count_and_chunk_size(tmp_path):
    src = corpus(tmp_path)
    outs = []
    for workers, chunk in (("1", "1048576"), ("2", "700"), ("2", "1048576")):
        out = tmp_path / f"out{workers}_{chunk}"
        proc = run_module(
            "plugins.data.prepare", "--input", str(src), "--out", str(out), "--workers", workers, "--chunk-bytes", chunk, "--val-fraction", "0.2", timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(out)
    first = json.loads((outs[0] / "meta.json").read_text())
    assert first["tokens"]["val"] > 0 and first["documents"] > 500
    for out in outs[1:]:
        for name in ("train.bin", "val.bin"):
            assert (out / name).read_bytes() == (outs[0] / name).read_bytes(), (out, name)
        meta = json.loads((out / "meta.json").read_text())
        assert (meta["tokens"], meta["documents"]) == (first["tokens"], first["documents"])
    assert first["tokens"]["train"] + first["tokens"]["val"] == sum((outs[0] / n).stat().st_size // 2 for n in ("train.bin", "val.bin"))


def test_progress_is_shown_while_a_file_is_read(tmp_path):
    src = tmp_path / "one.jsonl"
    src.write_text("".join(json.dumps({"text": f"line {i} " * 40}) + "\n" for i in range(400)))
    proc = run_module(
        "plugins.data.prepare",
        "--input",
        str(src),
        "--out",
        str(tmp_path / "o"),
        "--workers",
        "2",
        "--chunk-bytes",
        "4096",
        "--progress-interval",
        "0",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    bars = [line for line in proc.stderr.splitlines() if line.startswith("prepare [")]
    docs = [int(line.split(" docs")[0].rsplit("| ", 1)[1].replace(",", "")) for line in bars]
    assert len(bars) >= 10 and all("tokens/s" in b and "ETA" in b and "file 1/1" in b for b in bars)
    assert docs == sorted(docs) and docs[0] > 0 and sum(d < 400 for d in docs) >= 5 and docs[-1] == 400  # updates before the file ended
    assert "100.0%" in bars[-1] and "ETA 0:00:00" in bars[-1]


def test_parquet_without_the_text_column_is_one_line(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is in the data and dev extras; without it .parquet input is refused anyway")
    import pyarrow.parquet as pq

    (tmp_path / "good.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    pq.write_table(pa.table({"id": [1, 2], "content": ["a", "b"]}), tmp_path / "bad.parquet")
    out = tmp_path / "out"
    proc = prepare("--input", str(tmp_path / "good.jsonl"), str(tmp_path / "bad.parquet"), "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.parquet" in lines[0] and "'text'" in lines[0] and "columns present: id, content" in lines[0], lines
    assert not out.exists()  # refused before any tokenization


def test_bad_line_deep_in_a_file_leaves_no_partial_output(tmp_path):
    src = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": f"doc {i} " * 30}) for i in range(800)]
    lines[700] = '{"text": 5}'
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    proc = run_module("plugins.data.prepare", "--input", str(src), "--out", str(out), "--workers", "2", "--chunk-bytes", "2048", timeout=120)
    assert proc.returncode == 2 and "a.jsonl:701: 'text' is int" in proc.stderr, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == []


KILLED_WHILE_RENAMING = """
import os, signal, sys
from plugins.data import prepare
rename = os.replace
def replace(src, dst):
    rename(src, dst)
    if str(dst).endswith("train.bin"):  # killed between putting train.bin in place and the rest
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
sys.exit(prepare.main(sys.argv[1:]))
"""


def test_a_run_killed_while_renaming_is_redone_not_taken_as_complete(tmp_path):
    """A meta.json is the mark of a complete preparation: a run killed after its new train.bin is in
    place leaves no meta.json describing other files (a re-run with the old inputs would say "nothing
    to do" over the new train.bin), and a meta.json cut short or not
    matching the files' sizes makes the next run prepare again instead of crashing or skipping."""
    import subprocess
    import sys

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 4}) + "\n" for i in range(100)))
    out = tmp_path / "out"
    args = ["--input", str(src), "--out", str(out), "--val-fraction", "0.1", "--workers", "1"]
    assert run_module("plugins.data.prepare", *args).returncode == 0
    first = {n: (out / n).read_bytes() for n in ("train.bin", "val.bin", "meta.json")}
    stat = src.stat()
    src.write_text("".join(json.dumps({"text": f"other {i} " * 9}) + "\n" for i in range(100)))
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_RENAMING, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert not (out / "meta.json").exists(), "an old meta.json would vouch for the new train.bin"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 4}) + "\n" for i in range(100)))
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the first inputs again, to the second
    again = run_module("plugins.data.prepare", *args)
    assert again.returncode == 0 and "nothing to do" not in again.stderr, again.stderr
    assert {n: (out / n).read_bytes() for n in ("train.bin", "val.bin")} == {n: first[n] for n in ("train.bin", "val.bin")}
    (out / "meta.json").write_text(first["meta.json"].decode()[:40])  # cut short
    cut = run_module("plugins.data.prepare", *args)
    assert cut.returncode == 0 and "nothing to do" not in cut.stderr and "Traceback" not in cut.stderr, cut.stderr
    assert json.loads((out / "meta.json").read_text())["tokens"] == json.loads(first["meta.json"])["tokens"]
    with open(out / "train.bin", "r+b") as f:  # a train.bin shorter than meta.json counts
        f.truncate(100)
    short = run_module("plugins.data.prepare", *args)
    assert short.returncode == 0 and "nothing to do" not in short.stderr and (out / "train.bin").read_bytes() == first["train.bin"]
    assert "nothing to do" in run_module("plugins.data.prepare", *args).stderr  # complete now: skipped


def test_no_validation_split_writes_no_empty_val_bin(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    out = tmp_path / "out"
    out.mkdir()
    (out / "val.bin").write_bytes(b"\x01\x00" * 10)  # left from an earlier preparation
    assert prepare("--input", str(tmp_path / "a.txt"), "--out", str(out), "--val-fraction", "0").returncode == 0
    assert not (out / "val.bin").exists() and json.loads((out / "meta.json").read_text())["tokens"]["val"] == 0


MEASURE_RSS = """
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(proc.stderr)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # KiB: the largest of prepare and its workers
sys.exit(proc.returncode)
"""


@pytest.mark.parametrize("workers", ["1", "2"])
def test_memory_stays_bounded_on_a_large_file(tmp_path, workers):
    """40 MB of jsonl: the whole-file int64 arrays of the old preparation peaked near 1 GB on it
    (1.4 GB measured on 60 MB); streamed, prepare and each worker stay under 150 MB."""
    import subprocess
    import sys

    from conftest import REPO, env

    src = tmp_path / "big.jsonl"
    line = [json.dumps({"id": i, "text": f"{i} " + "the quick brown fox jumps over the lazy dog " * 100}) + "\n" for i in range(64)]
    with src.open("w") as f:
        for k in range(40_000_000 // sum(map(len, line)) + 1):
            f.write("".join(line))
    size = src.stat().st_size
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            MEASURE_RSS,
            sys.executable,
            "-m",
            "plugins.data.prepare",
            "--input",
            str(src),
            "--out",
            str(tmp_path / "out"),
            "--workers",
            workers,
        ],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    peak_mb = int(proc.stdout.split()[-1]) / 1024
    tokens = json.loads((tmp_path / "out" / "meta.json").read_text())["tokens"]
    assert size > 40e6 and tokens["train"] + tokens["val"] > 40e6
    assert peak_mb < 150, f"peak RSS {peak_mb:.0f} MB for a {size / 1e6:.0f} MB input"
