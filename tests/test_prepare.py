"""The tokenization command: round trips, idempotence, parquet, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_module

DOCS = ["Shall I compare thee to a summer's day?", "Thou art more lovely and more temperate:", "Rough winds do shake — ünïcödé"]


def prepare(*args):
    return run_module("plugins.data.prepare", *args, "--workers", "2", timeout=120)


def split_docs(ids: np.ndarray, eos: int) -> list[np.ndarray]:
    cuts = np.flatnonzero(ids == eos)
    return [ids[a + 1 if i else 0: b] for i, (a, b) in enumerate(zip(np.r_[-1, cuts[:-1]], cuts))]


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
    tok.train_from_iterator(DOCS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:2]))
    pq.write_table(pa.table({"text": DOCS[2:]}), tmp_path / "more.parquet")
    out = tmp_path / "out"
    proc = prepare("--input", str(tmp_path / "docs.jsonl"), str(tmp_path / "more.parquet"), "--out", str(out),
                   "--tokenizer", f"hf:{tmp_path / 'tokenizer.json'}", "--val-fraction", "0")
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


@pytest.mark.parametrize("make, match", [
    (lambda d: None, "no such file or folder"),
    (lambda d: (d.mkdir(), (d / "a.txt").write_text("")), "empty input"),
    (lambda d: (d.mkdir(), (d / "a.jsonl").write_text("{oops\n")), "a.jsonl:1: not a JSON object"),
    (lambda d: (d.mkdir(), (d / "a.txt").write_bytes(b"\xff\xfe\xfa")), "unreadable"),
])
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
    proc = prepare("--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), "--tokenizer", f"tiktoken:{ranks}",
                   "--eos-id", "70000", "--dtype", "uint16")
    assert proc.returncode == 2 and "more than uint16 holds" in proc.stderr
