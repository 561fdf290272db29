"""The tokenizer a checkpoint's data was made with, kept findable when the checkpoint moves.

``state.json`` records the tokenizer the data source declared (:mod:`core.data.tokenizer_spec`):
its file's absolute path and sha256. A checkpoint copied to another machine, or a run folder moved,
finds nothing at that path, so the commit (rank 0, :func:`record_for`) adds two ways to find it:

- ``relative``: the file's path relative to the checkpoint folder, for a run folder moved together
  with the tokenizer (a project folder holding both, moved or copied whole);
- ``copy``: the file itself, copied into the checkpoint folder (``tokenizer.json`` or
  ``tokenizer.tiktoken``) when it is at most :data:`COPY_LIMIT` bytes, for a checkpoint that travels
  alone. Tokenizer files are small beside any checkpoint of a model that uses them (GPT-2's BPE
  1.4 MB, Llama 3's 8.7 MB, Gemma 3's 33 MB, against hundreds of MB to many GB of weights and
  optimizer state); 64 MiB takes them all and leaves out only what is not an ordinary tokenizer.

:func:`core.cli.text_codec.recorded_tokenizer` tries the recorded path, then these, each only when its
sha256 is the recorded one. A file that changed since the run started is not copied (said once).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from core.contract import log

COPY_LIMIT = 64 * 2**20
COPY_NAMES = {"hf": "tokenizer.json", "tiktoken": "tokenizer.tiktoken"}  # by kind; what pruning knows a save wrote


def record_for(checkpoint: Path, record: dict[str, Any] | None) -> dict[str, Any] | None:
    """``state.json``'s tokenizer record for the checkpoint folder ``checkpoint`` (rank 0, at its commit,
    before the manifest lists its files): ``relative`` added, and ``copy`` once the file is written there."""
    if not isinstance(record, dict) or not isinstance(record.get("fingerprint"), str):
        return record  # bytes (no file), or nothing declared
    kind, _, name = record["spec"].partition(":")
    file = Path(name)
    out = dict(record, relative=os.path.relpath(file, checkpoint.resolve()))
    try:
        if file.stat().st_size > COPY_LIMIT:
            log.warn(f"tokenizer {file} is over {COPY_LIMIT // 2**20} MiB: not copied into checkpoints (state.json records its path)", once="tokenizer-large")
            return out
        data = file.read_bytes()
    except OSError as e:
        log.warn(
            f"tokenizer {file}: not copied into the checkpoint ({type(e).__name__}: {e.strerror or e}); state.json records its path", once="tokenizer-gone"
        )
        return out
    if hashlib.sha256(data).hexdigest() != record["fingerprint"]:
        log.warn(
            f"tokenizer {file} changed since the run started (sha256): not copied into checkpoints; state.json records the first one's",
            once="tokenizer-changed",
        )
        return out
    with open(checkpoint / COPY_NAMES[kind], "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    out["copy"] = COPY_NAMES[kind]
    return out
