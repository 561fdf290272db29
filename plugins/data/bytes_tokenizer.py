"""Byte-level tokens: ids 0-255 are bytes, 256 ends a document."""

from __future__ import annotations

EOS_ID = 256
VOCAB_SIZE = 257


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")
