"""A recorded tokenizer that is not found or has changed (its sha256) says what to pass; text_stream and
the mixture declare their tokenizer through the seam a third party uses (``tokenizer()``), and a mixture
refuses sources of two tokenizers."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from conftest import run_here
from shared import bpe, error_lines, prepared_project

from core.contract.errors import DataError


def test_a_recorded_tokenizer_not_found_or_changed_says_what_to_pass(tmp_path, capsys):
    """Nothing with the recorded sha256 at the recorded path, relative to the checkpoint or as its
    copy: one line naming where it looked and the sha256 to pass; a file there that changed: one line
    naming both files' sha256; ``--tokenizer`` with another file: a warning naming both."""
    from core.cli.text_codec import recorded_tokenizer

    ckpt = tmp_path / "run" / "checkpoints" / "step_000000003"
    ckpt.mkdir(parents=True)
    tok = bpe(tmp_path / "tok")
    digest = hashlib.sha256(tok.read_bytes()).hexdigest()
    record = {"spec": "hf:/gone/tok/tokenizer.json", "eos_id": 0, "fingerprint": digest, "relative": "../../../tok/tokenizer.json"}
    (ckpt / "state.json").write_text(json.dumps({"tokenizer": record}))
    assert recorded_tokenizer(ckpt, {}, "ckpt").spec == f"hf:{tok}"  # relative to the checkpoint
    shutil.move(tok, tmp_path / "tok" / "moved.json")
    with pytest.raises(DataError) as e:
        recorded_tokenizer(ckpt, {}, "ckpt")
    assert str(e.value) == (
        f"{ckpt / 'state.json'} tokenizer: hf:/gone/tok/tokenizer.json not found (looked at /gone/tok/tokenizer.json, "
        f"{ckpt / '../../../tok/tokenizer.json'}); pass --tokenizer hf:PATH, the file with sha256 {digest[:12]}..."
    )
    (ckpt / "tokenizer.json").write_text("{}")  # a copy that is not the recorded file is never taken
    (ckpt / "state.json").write_text(json.dumps({"tokenizer": {**record, "copy": "tokenizer.json"}}))
    with pytest.raises(
        DataError,
        match=rf"tokenizer.json has sha256 {hashlib.sha256(b'{}').hexdigest()[:12]}\.\.\., the run's tokenizer hf:/gone/tok/tokenizer.json had {digest[:12]}",
    ):
        recorded_tokenizer(ckpt, {}, "ckpt")
    shutil.copyfile(tmp_path / "tok" / "moved.json", ckpt / "tokenizer.json")
    assert recorded_tokenizer(ckpt, {}, "ckpt").spec == f"hf:{ckpt / 'tokenizer.json'}"
    # --tokenizer is used as given; another file than the recorded one is said in one line naming both
    from core.cli.text_codec import TokenizerRecord, check_against_recorded

    capsys.readouterr()
    check_against_recorded(TokenizerRecord(f"hf:{ckpt / 'tokenizer.json'}", None, "--tokenizer"), ckpt)
    assert capsys.readouterr().err == ""
    other = tmp_path / "other.json"
    other.write_text("{}")
    check_against_recorded(TokenizerRecord(f"hf:{other}", None, "--tokenizer"), ckpt)
    assert (
        f"--tokenizer {other} (sha256 {hashlib.sha256(b'{}').hexdigest()[:12]}...) is not the tokenizer {ckpt} was trained with "
        f"(hf:/gone/tok/tokenizer.json, sha256 {digest[:12]}...): used as given"
    ) in capsys.readouterr().err


def test_text_stream_and_mixture_declare_their_tokenizer_and_a_mixture_refuses_two(tmp_path, monkeypatch):
    """text_stream declares its [data] tokenizer; a mixture the one its sources agree on (through each
    source's own tokenizer()), and sources of different tokenizers are one line naming both, in core.plan too."""
    pytest.importorskip("tokenizers", reason="the Hugging Face tokenizers library is a dependency of the 'dev' extra")
    from core.data.tokenizer_spec import declared_tokenizer
    from plugins.data.mixture import Mixture, MixtureOptions
    from plugins.data.text_stream import TextStream, TextStreamOptions

    proj = tmp_path / "proj"
    tok = prepared_project(proj, monkeypatch)
    digest = hashlib.sha256(tok.read_bytes()).hexdigest()
    stream = {"name": "text_stream", "files": ["corpus.jsonl"]}
    assert declared_tokenizer(TextStream(TextStreamOptions(files=["corpus.jsonl"])), "s") == {"spec": "bytes", "eos_id": None, "fingerprint": None}
    bins = {"name": "token_bin", "weight": 1.0, "path": "data"}
    agree = Mixture(MixtureOptions(sources=[bins, {**stream, "weight": 1.0, "tokenizer": "hf:tok/tokenizer.json"}, {"name": "synthetic", "weight": 1.0}]))
    assert declared_tokenizer(agree, "m") == {"spec": f"hf:{tok}", "eos_id": 0, "fingerprint": digest}
    differ = Mixture(MixtureOptions(sources=[bins, {**stream, "weight": 1.0, "label": "chat"}]))
    with pytest.raises(DataError, match=rf"sources '0_token_bin' \(hf:{tok}\) and 'chat' \(bytes\) declare different tokenizers"):
        declared_tokenizer(differ, "m")
    cfg = (
        (proj / "run.toml")
        .read_text()
        .replace(
            'name = "token_bin"',
            'name = "mixture"\nsources = [{name = "token_bin", weight = 1.0, path = "data"}, {name = "text_stream", weight = 1.0, files = ["corpus.jsonl"], label = "chat"}]',
        )
    )
    cfg = cfg.replace(f'path = "{proj / "data"}"\n', "")
    (proj / "mixed.toml").write_text(cfg)
    plan = run_here("core.plan", "--config", "mixed.toml", cwd=proj)
    assert plan.returncode == 2 and len(error_lines(plan)) == 1, plan.stderr[-3000:]
    assert "declare different tokenizers" in error_lines(plan)[0] and "'chat' (bytes)" in error_lines(plan)[0]
