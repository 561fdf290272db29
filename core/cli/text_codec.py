"""The tokenizer a model was trained with: found from a checkpoint's config, loaded, decoded.

The data preparation (``plugins.data.prepare``) records its tokenizer in
``<data path>/meta.json`` (``tokenizer``: ``bytes``, ``hf:PATH/tokenizer.json``
or ``tiktoken:FILE``, with ``eos_id`` and the file's sha256 as
``tokenizer_fingerprint``); ``text_stream`` names it in the data section
itself (``tokenizer``). :func:`find_in_config` follows a resolved config's
``[data]`` section (and a mixture's ``sources``) to that record, generically:
a section's ``tokenizer`` key, or the ``meta.json`` in its ``path`` folder.
Every data source, the built-in ones and a third party's, declares its
tokenizer (its optional ``tokenizer()``, :mod:`core.data.tokenizer_spec`): the
run records it in each checkpoint's ``state.json``, and :func:`recorded_tokenizer`
reads that record (found again when moved: :mod:`core.checkpoint.folders`);
the ``[data]`` reading is the fallback for checkpoints saved before the record.

Encoding is :class:`core.data.text_tokenizer.Tokenizer`'s (one definition of
what the data holds); decoding is added here. Nothing here runs code from a
checkpoint or an export: only JSON is read.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.contract.errors import DataError
from core.data.tokenizer_spec import TOKENIZER_KINDS, tokenizer_fingerprint


@dataclass(frozen=True)
class TokenizerRecord:
    """A tokenizer spec with every file path absolute, its EOS id if recorded, and where it was found."""

    spec: str
    eos_id: int | None
    source: str

    @property
    def kind(self) -> str:
        return self.spec.partition(":")[0]

    @property
    def file(self) -> Path | None:
        kind, _, path = self.spec.partition(":")
        return Path(path) if kind != "bytes" else None


def resolve(spec: str, bases: list[Path], where: str, want_fingerprint: str | None = None) -> str:
    """``spec`` with its file as an absolute path: as given when absolute, else the first of
    ``base / path`` for ``bases`` that exists (and has ``want_fingerprint``, when given)."""
    kind, _, path = spec.partition(":")
    if kind not in TOKENIZER_KINDS or (kind == "bytes") != (not path):
        raise DataError(f"{where}: tokenizer {spec!r}: expected bytes, hf:PATH or tiktoken:PATH")
    if kind == "bytes":
        return "bytes"
    p = Path(path).expanduser()
    candidates = [p] if p.is_absolute() else [b / p for b in bases]
    found = [c.resolve() for c in candidates if c.is_file()]
    if not found:
        looked = ", ".join(str(c) for c in candidates)
        raise DataError(f"{where}: tokenizer {spec!r} not found (looked at {looked}); pass --tokenizer SPEC")
    if want_fingerprint:
        try:
            matching = [f for f in found if tokenizer_fingerprint(f) == want_fingerprint]
        except OSError as e:  # a file too large for a tokenizer's, or gone since
            raise DataError(f"{where}: tokenizer {spec!r}: {e.filename} cannot be read ({e.strerror or e})") from None
        if not matching:
            raise DataError(
                f"{where}: tokenizer file {found[0]} differs from the one the data was prepared with "
                "(sha256 fingerprint); pass --tokenizer SPEC to use it anyway"
            )
        found = matching
    return f"{kind}:{found[0]}"


def read_json(file: Path) -> dict[str, Any]:
    """A JSON object of a run or data folder (``run_info.json``, a checkpoint's ``state.json``, ``meta.json``):
    a pipe or a device in its place, or a value nested without end, is refused, never read (:mod:`core.runtime.small_files`)."""
    from core.runtime import small_files

    try:
        data = small_files.read_json(file)
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON, an integer too long
        raise DataError(f"{file}: not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _eos(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DataError(f"{where}: eos_id {value!r} is not a token id")
    return value


def _from_section(section: dict[str, Any], where: str) -> list[TokenizerRecord]:
    found: list[TokenizerRecord] = []
    tok = section.get("tokenizer")
    if isinstance(tok, str) and tok:
        found.append(TokenizerRecord(resolve(tok, [Path.cwd()], f"{where} tokenizer"), None, f"{where} tokenizer"))
    path = section.get("path")
    if isinstance(path, str) and path and (Path(path) / "meta.json").is_file():
        meta_file = Path(path) / "meta.json"
        meta = read_json(meta_file)
        spec = meta.get("tokenizer")
        if isinstance(spec, str) and spec:
            resolved = resolve(spec, [Path.cwd(), meta_file.parent], str(meta_file), meta.get("tokenizer_fingerprint"))
            found.append(TokenizerRecord(resolved, _eos(meta.get("eos_id"), str(meta_file)), str(meta_file)))
    for i, source in enumerate(section.get("sources") or []):
        if isinstance(source, dict):
            found += _from_section(source, f"{where} sources[{i}]")
    return found


def find_in_config(config: dict[str, Any], where: str) -> TokenizerRecord | None:
    """The tokenizer of a resolved config's data, or None when it names none (synthetic data,
    a token_bin folder without meta.json). Sources that disagree are a DataError."""
    section = config.get("data")
    if not isinstance(section, dict):
        return None
    found = _from_section(section, f"{where} [data]")
    specs = sorted({r.spec for r in found})
    if len(specs) > 1:
        raise DataError(f"{where}: the data sources use different tokenizers ({', '.join(specs)}); pass --tokenizer SPEC")
    if not found:
        return None
    eos = {r.eos_id for r in found if r.eos_id is not None}
    if len(eos) > 1:
        raise DataError(f"{where}: the data sources record different EOS ids {sorted(eos)}; pass --tokenizer SPEC")
    return TokenizerRecord(specs[0], eos.pop() if eos else None, found[0].source)


def _sha256(file: Path, where: str) -> str:
    """The tokenizer file's sha256, or one line naming it when it cannot be one (too large, unreadable)."""
    try:
        return tokenizer_fingerprint(file)
    except OSError as e:
        raise DataError(f"{where}: {file} cannot be read as a tokenizer file ({e.strerror or e}); pass --tokenizer SPEC") from None


def recorded_tokenizer(checkpoint: Path, config: dict[str, Any], where: str) -> TokenizerRecord | None:
    """The tokenizer checkpoint ``checkpoint`` recorded in its ``state.json`` (the data source's declared
    ``tokenizer()``), else :func:`find_in_config` of its resolved config (a checkpoint saved before
    the record). The recorded file is looked for at its recorded path, then relative to the checkpoint
    (a run folder moved with its tokenizer), then as the copy in the checkpoint folder
    (:mod:`core.checkpoint.folders`); only a file with the recorded sha256 is taken."""
    from core.checkpoint import COPY_NAMES

    record = read_json(checkpoint / "state.json").get("tokenizer")
    if not isinstance(record, dict) or not isinstance(record.get("spec"), str):
        return find_in_config(config, where)
    where = f"{checkpoint / 'state.json'} tokenizer"
    eos, want = _eos(record.get("eos_id"), where), record.get("fingerprint")
    kind, _, path = record["spec"].partition(":")
    if kind not in TOKENIZER_KINDS or (kind == "bytes") != (not path):
        raise DataError(f"{where}: {record['spec']!r} is not bytes, hf:PATH or tiktoken:PATH with its sha256; pass --tokenizer SPEC")
    if kind == "bytes":
        return TokenizerRecord("bytes", eos, where)
    if not isinstance(want, str):
        raise DataError(f"{where}: {record['spec']!r} is recorded without its sha256; pass --tokenizer SPEC")
    candidates = [Path(path)]
    if isinstance(record.get("relative"), str):
        candidates.append(checkpoint / record["relative"])
    if record.get("copy") == COPY_NAMES[kind]:  # a name of its own, never a path from the file
        candidates.append(checkpoint / COPY_NAMES[kind])
    found = [c for c in candidates if c.is_file()]
    for c in found:
        if _sha256(c, where) == want:
            return TokenizerRecord(f"{kind}:{c.resolve()}", eos, where)
    if found:
        raise DataError(
            f"{where}: {found[0]} has sha256 {_sha256(found[0], where)[:12]}..., the run's tokenizer {record['spec']} had {want[:12]}...; "
            f"pass --tokenizer {kind}:PATH of the run's file (or --tokenizer {kind}:{found[0]} to use this one anyway)"
        )
    raise DataError(
        f"{where}: {record['spec']} not found (looked at {', '.join(map(str, candidates))}); pass --tokenizer {kind}:PATH, the file with sha256 {want[:12]}..."
    )


def check_against_recorded(given: TokenizerRecord, checkpoint: Path) -> None:
    """``--tokenizer`` is used as given; a file other than the one the checkpoint recorded (sha256) is said in one line naming both."""
    state = checkpoint / "state.json"
    record = read_json(state).get("tokenizer") if state.is_file() else None
    if not isinstance(record, dict) or given.file is None or not isinstance(record.get("fingerprint"), str):
        return
    if (got := _sha256(given.file, "--tokenizer")) != record["fingerprint"]:
        from core.contract import log

        log.warn(
            f"--tokenizer {given.file} (sha256 {got[:12]}...) is not the tokenizer {checkpoint} was trained with ({record['spec']}, sha256 {record['fingerprint'][:12]}...): used as given"
        )


class Codec:
    """Text <-> ids with the tokenizer of ``record``: ``encode``, ``decode``, ``eos_id``, ``vocab_size``."""

    def __init__(self, record: TokenizerRecord) -> None:
        from core.data.text_tokenizer import Tokenizer

        self.record = record
        tok = Tokenizer(record.spec, record.eos_id)  # DataError for a bad spec or a missing file
        self.encode = tok.encode
        self.eos_id: int = tok.eos_id
        self.vocab_size: int = tok.vocab_size
        self._decode_hf = None
        self._ranks: dict[int, bytes] = {}
        if record.kind == "hf":
            from tokenizers import Tokenizer as HFTokenizer

            self._decode_hf = HFTokenizer.from_file(str(record.file))
        elif record.kind == "tiktoken":
            self._ranks = {
                int(rank): base64.b64decode(token) for token, rank in (line.split() for line in Path(str(record.file)).read_text().splitlines() if line)
            }

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; the EOS id and ids the tokenizer does not know are left out."""
        ids = [int(i) for i in ids if int(i) != self.eos_id and 0 <= int(i) < self.vocab_size]
        if self.record.kind == "bytes":
            from plugins.data.bytes_tokenizer import decode

            return decode(ids)
        if self._decode_hf is not None:
            return self._decode_hf.decode(ids, skip_special_tokens=False)
        return b"".join(self._ranks.get(i, b"") for i in ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str | None:
        """The EOS token's string form for a Hugging Face tokenizer (None for bytes / tiktoken)."""
        return self._decode_hf.id_to_token(token_id) if self._decode_hf is not None else None
