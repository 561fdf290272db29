"""token_bin records its tokenizer in each checkpoint's ``state.json``, and a run folder, tokenizer or
checkpoint moved alone still exports and generates (the record found relative to the checkpoint, or the
copy in it, its sha256 checked); a checkpoint saved without the record exports through its ``[data]``
section."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import run_module
from shared import prepared_project

CKPT = Path("out") / "checkpoints" / "step_000000003"


def rewrite_state(ckpt: Path, state: dict) -> None:
    """``state.json`` replaced, and the COMMITTED manifest made to list it (a checkpoint as an older plait wrote it)."""
    from core.checkpoint import folders as integrity

    (ckpt / "state.json").write_text(json.dumps(state, indent=1))
    manifest = json.loads((ckpt / "COMMITTED").read_text())
    (ckpt / "COMMITTED").write_text(json.dumps({**manifest, **integrity.manifest_files(ckpt, exclude="COMMITTED", known={})}, indent=1))


@pytest.mark.slow  # spawns plait's commands
def test_token_bin_records_its_tokenizer_and_a_moved_run_still_exports_and_generates(tmp_path, monkeypatch):
    """token_bin named its tokenizer only in meta.json, which export and generate read through the
    [data] section: with the data folder moved they found nothing. It declares it now; the record
    holds the path relative to the checkpoint and a copy of the file, so moving the run folder with
    its tokenizer, then the tokenizer elsewhere, still exports and generates."""
    pytest.importorskip("tokenizers", reason="the Hugging Face tokenizers library is a dependency of the 'dev' extra")
    proj = tmp_path / "proj"
    tok = prepared_project(proj, monkeypatch)
    train = run_module("core.train", "--config", "run.toml", "--checkpoint.every=1", "--checkpoint.keep_latest=1", cwd=proj)
    assert train.returncode == 0, train.stderr[-3000:]
    ckpt = proj / CKPT
    assert [p.name for p in ckpt.parent.glob("step_*")] == [ckpt.name] and "the folder stays" not in train.stderr  # the copy is the save's: pruned
    recorded = json.loads((ckpt / "state.json").read_text())["tokenizer"]
    digest = hashlib.sha256(tok.read_bytes()).hexdigest()
    assert recorded == {"spec": f"hf:{tok}", "eos_id": 0, "fingerprint": digest, "relative": "../../../tok/tokenizer.json", "copy": "tokenizer.json"}
    assert (ckpt / "tokenizer.json").read_bytes() == tok.read_bytes()

    shutil.move(proj, tmp_path / "moved")  # the whole project: run folder, data and tokenizer; nothing at the recorded paths
    ckpt = tmp_path / "moved" / CKPT
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for step, setup in enumerate(("moved together", "tokenizer moved away")):
        if setup == "tokenizer moved away":
            shutil.move(tmp_path / "moved" / "tok", elsewhere / "tok")  # only the copy in the checkpoint is left
        out = tmp_path / f"export{step}"
        export = run_module("core.export", "--checkpoint", str(ckpt), "--format", "hf", "--out", str(out), cwd=elsewhere)
        assert export.returncode == 0 and "no tokenizer exported" not in export.stderr, (setup, export.stderr[-3000:])
        assert (out / "tokenizer.json").read_bytes() == (
            elsewhere / "tok" / "tokenizer.json" if step else tmp_path / "moved" / "tok" / "tokenizer.json"
        ).read_bytes()
        gen = run_module("core.generate", "--checkpoint", str(ckpt), "--prompt", "to be", "--max-new-tokens", "4", cwd=elsewhere)
        assert gen.returncode == 0 and gen.stdout.startswith("to be"), (setup, gen.stderr[-3000:])


@pytest.mark.slow  # spawns plait's commands
def test_a_checkpoint_saved_before_the_record_exports_through_its_data_section(tmp_path, monkeypatch):
    """A state.json without ``tokenizer`` (as saved before data sources declared it): the [data]
    section's meta.json still names the tokenizer, relative to the working directory."""
    pytest.importorskip("tokenizers", reason="the Hugging Face tokenizers library is a dependency of the 'dev' extra")
    proj = tmp_path / "proj"
    tok = prepared_project(proj, monkeypatch)
    train = run_module("core.train", "--config", "run.toml", cwd=proj)
    assert train.returncode == 0, train.stderr[-3000:]
    ckpt = proj / CKPT
    state = json.loads((ckpt / "state.json").read_text())
    del state["tokenizer"]
    (ckpt / "tokenizer.json").unlink(missing_ok=True)
    rewrite_state(ckpt, state)
    export = run_module("core.export", "--checkpoint", str(ckpt), "--format", "safetensors", "--out", str(tmp_path / "st"), cwd=proj)
    assert export.returncode == 0 and "no tokenizer exported" not in export.stderr, export.stderr[-3000:]
    assert (tmp_path / "st" / "tokenizer.json").read_bytes() == tok.read_bytes()
    gen = run_module("core.generate", "--checkpoint", str(ckpt), "--prompt", "to be", "--max-new-tokens", "4", cwd=proj)
    assert gen.returncode == 0 and gen.stdout.startswith("to be"), gen.stderr[-3000:]
