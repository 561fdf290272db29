"""Helpers that test modules in different folders share (``tests/`` is on ``sys.path`` beside
``conftest``): a tokenizer trained here, a command's error lines, a crafted checkpoint."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

from core.checkpoint.integrity import manifest_files


def bpe(folder: Path) -> Path:
    """A 300-token byte-level BPE trained here (no download), saved as ``folder/tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    docs = ["to be or not to be, that is the question. " * 4, "whether tis nobler in the mind to suffer"] * 20
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("plait: error: ")]


class RunsAShellCommand:
    """Pickles to a call of os.system: what a crafted checkpoint would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def recommit(folder: Path) -> None:
    """Rewrite COMMITTED to match the files as they are now (a buggy writer, or an attacker)."""
    manifest = json.loads((folder / "COMMITTED").read_text())
    manifest.update(manifest_files(folder, exclude="COMMITTED", known={}))
    (folder / "COMMITTED").write_text(json.dumps(manifest))


def craft_metadata(folder: Path, marker: Path) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(RunsAShellCommand(marker)))
    recommit(folder)
