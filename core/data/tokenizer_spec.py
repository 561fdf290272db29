"""The tokenizer a data source declares (its optional ``tokenizer()``, ``core/contract/members.py``).

A source that knows the tokenizer its token ids come from returns a :class:`TokenizerSpec`; the
core resolves its file to an absolute path with the file's sha256 (:func:`declared_tokenizer`,
before anything is built: a bad answer is one line, exit 2, ``core.plan`` too) and records it in
every checkpoint's ``state.json`` (``tokenizer``), where ``core.export`` and ``core.generate``
find it (:func:`core.cli.text_codec.recorded_tokenizer`; the commit adds its path relative to the
checkpoint and a copy of the file, :mod:`core.checkpoint.folders`). The built-in sources declare
theirs the same way. For a checkpoint saved before the record they follow the ``[data]`` section
as the built-in sources write it (a ``tokenizer`` key, or the ``meta.json`` of its ``path``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.contract.errors import DataError, PluginError

TOKENIZER_KINDS = ("bytes", "hf", "tiktoken")  # a tokenizer spec's kinds: "bytes", "hf:PATH", "tiktoken:PATH"


MAX_TOKENIZER_BYTES = 2**30  # the largest tokenizer files are tens of megabytes


def read_tokenizer_file(file: Path) -> bytes:
    """The bytes of a tokenizer file, which a checkpoint's ``state.json`` may name: a regular file of at
    most :data:`MAX_TOKENIZER_BYTES`, else OSError before anything is read (a record naming a sparse
    file of terabytes, a disk image, a pipe or a device is never read into memory or waited on)."""
    from core.runtime import small_files

    return small_files.read_bytes(file, MAX_TOKENIZER_BYTES)


def tokenizer_fingerprint(file: Path) -> str:
    """The tokenizer file's sha256, as ``meta.json`` and ``state.json`` record it. Raises OSError."""
    return hashlib.sha256(read_tokenizer_file(file)).hexdigest()


@dataclass(frozen=True)
class TokenizerSpec:
    """``spec``: ``"bytes"``, ``"hf:PATH/tokenizer.json"`` or ``"tiktoken:PATH"`` (a relative PATH is
    from the working directory); ``eos_id``: its end-of-sequence id, None for the tokenizer's own."""

    spec: str
    eos_id: int | None = None


def declared_tokenizer(data: Any, who: str) -> dict[str, Any] | None:
    """The data source's ``tokenizer()`` as ``state.json`` records it: ``{"spec", "eos_id", "fingerprint"}``
    with the file's absolute path; None when it declares none (or returns None)."""
    from core.contract.members import member, returned  # here: the data preparation CLI reads tokenizer files without torch

    fn = member("data", data, "tokenizer")
    answer = fn() if fn is not None else None
    if answer is None:
        return None
    declared = returned(answer, TokenizerSpec, f"{who}: tokenizer()", "a core.api.TokenizerSpec or None")
    eos = declared.eos_id
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or eos < 0):
        raise PluginError(f"{who}: tokenizer() returned eos_id {eos!r}; expected a token id (an int >= 0) or None")
    kind, _, path = declared.spec.partition(":") if isinstance(declared.spec, str) else ("", "", "")
    if kind not in TOKENIZER_KINDS or (kind == "bytes") != (not path):
        raise PluginError(f"{who}: tokenizer() returned spec {declared.spec!r}; expected bytes, hf:PATH or tiktoken:PATH")
    if kind == "bytes":
        return {"spec": "bytes", "eos_id": eos, "fingerprint": None}
    file = (Path.cwd() / Path(path).expanduser()).resolve()  # an absolute path stays as it is
    if not file.is_file():
        raise DataError(f"{who}: tokenizer() names {declared.spec!r}, and {file} is not a file")
    try:
        return {"spec": f"{kind}:{file}", "eos_id": eos, "fingerprint": tokenizer_fingerprint(file)}
    except OSError as e:
        raise DataError(f"{who}: tokenizer() names {declared.spec!r}, and {file} cannot be read ({e.strerror or e})") from None


def data_end_of_document_id(data: Any, who: str) -> int | None:
    """The token id that ends each document of the source's samples: its optional ``end_of_document_id()``,
    else the ``eos_id`` its ``tokenizer()`` declares; None when neither says. Loaders hand out ids only:
    a model with a document mask finds the documents in them (``core.contract.members``)."""
    from core.contract.members import member

    fn = member("data", data, "end_of_document_id")
    if fn is None:
        record = declared_tokenizer(data, who)
        return None if record is None else record["eos_id"]
    eod = fn()
    if eod is not None and (isinstance(eod, bool) or not isinstance(eod, int) or eod < 0):
        raise PluginError(f"{who}: end_of_document_id() returned {eod!r}; expected a token id (an int >= 0) or None")
    return eod
