"""Text to token ids (:class:`Tokenizer`): ``bytes``, ``hf:PATH/tokenizer.json`` or ``tiktoken:PATH``,
with its EOS id and a fingerprint of its file; the one encoding of data preparation, ``text_stream``
and ``core.generate`` (tests/test_text_data.py, tests/e2e/test_generate.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from core.contract.errors import DataError
from core.data.tokenizer_spec import TOKENIZER_KINDS, read_tokenizer_file


def need(module: str, what: str) -> None:
    """Import ``module`` (an optional dependency, the ``data`` extra) or say in one line that ``what`` needs it."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        raise DataError(f"{what} needs the {module.split('.')[0]} library (pip install 'plait[data]'): {e}") from None


class Tokenizer:
    """bytes, hf:tokenizer.json or tiktoken:FILE, with an EOS id and a fingerprint. A bad spec, file or
    EOS id is a DataError naming ``where`` (the ``--tokenizer`` flag or the ``tokenizer`` key)."""

    def __init__(self, spec: str, eos_id: int | None, where: str = "tokenizer") -> None:
        self.spec = spec
        kind, _, path = spec.partition(":")
        if kind not in TOKENIZER_KINDS or (kind == "bytes") != (not path):
            raise DataError(f"{where} {spec!r}: expected bytes, hf:PATH/tokenizer.json or tiktoken:PATH")
        if kind == "bytes":
            if eos_id not in (None, 256):
                raise DataError(f"--eos-id {eos_id}: the bytes tokenizer's EOS is always 256")
            self.vocab_size, self.eos_id, self.fingerprint = 257, 256, "bytes"
            self._encode = lambda text: list(text.encode("utf-8"))
            self._encode_many = lambda texts: [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
            return
        file = Path(path)
        if not file.is_file():
            rel = "" if file.is_absolute() else f" (a relative path is taken from the working directory, {Path.cwd()})"
            raise DataError(f"{where} {spec!r}: {file} not found{rel}")
        try:
            data = read_tokenizer_file(file)  # a regular file of a tokenizer's size, never a device or a sparse image
        except OSError as e:
            raise DataError(f"{where} {spec!r}: {file} unreadable ({type(e).__name__}: {e.strerror or e})") from None
        self.fingerprint = hashlib.sha256(data).hexdigest()
        if kind == "hf":
            need("tokenizers", f"{where} {spec!r}")
            from tokenizers import Tokenizer as HFTokenizer

            try:
                tok = HFTokenizer.from_str(data.decode("utf-8"))
            except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
                raise DataError(f"{where} {spec!r}: {file} is not a tokenizers JSON file ({e})") from None
            self.vocab_size = tok.get_vocab_size()
            eos = eos_id
            if eos is None:
                for name in ("<|endoftext|>", "</s>", "<|end_of_text|>", "[EOS]", "<eos>"):
                    eos = tok.token_to_id(name)
                    if eos is not None:
                        break
            if eos is None:
                raise DataError(f"{where} {spec!r}: no EOS token found; pass --eos-id")
            if not 0 <= eos < self.vocab_size:
                raise DataError(f"--eos-id {eos}: outside the ids of {where} {spec!r}, expected 0 to {self.vocab_size - 1}")
            self.eos_id = eos
            self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
            self._encode_many = lambda texts: [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(texts, add_special_tokens=False)]
        else:
            import base64

            need("tiktoken", f"{where} {spec!r}")
            import tiktoken

            try:
                ranks = {
                    base64.b64decode(token, validate=True): int(rank) for token, rank in (line.split() for line in data.decode("utf-8").splitlines() if line)
                }
            except ValueError as e:  # a line that is not "base64 rank" (binascii.Error and UnicodeDecodeError included)
                raise DataError(f"{where} {spec!r}: {file} is not a tiktoken ranks file of 'base64 rank' lines ({e})") from None
            if not ranks:
                raise DataError(f"{where} {spec!r}: {file} holds no 'base64 rank' lines")
            if eos_id is None:
                eos_id = len(ranks)
            elif not 0 <= eos_id < 2**32:  # tiktoken's ids are 32-bit
                raise DataError(f"--eos-id {eos_id}: expected a token id from 0 to {2**32 - 1}")
            elif eos_id in ranks.values():
                raise DataError(f"--eos-id {eos_id}: already the id of a token of {where} {spec!r}; expected an id of its own (default {len(ranks)})")
            enc = tiktoken.Encoding(
                name=file.stem,
                pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                mergeable_ranks=ranks,
                special_tokens={"<|endoftext|>": eos_id},
            )
            self.vocab_size, self.eos_id = max(len(ranks), eos_id + 1), eos_id
            self._encode = lambda text: enc.encode_ordinary(text)
            self._encode_many = lambda texts: [np.asarray(enc.encode_ordinary(t), dtype=np.int64) for t in texts]

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text (without EOS), as integer arrays: the preparation's fast path."""
        return self._encode_many(texts)
