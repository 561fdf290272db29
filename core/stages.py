"""Sequence-length stages (``data.seq_len_stages``): shorter sequences early in the run.

A stage keeps the tokens per micro-batch (``micro_batch x seq_len``) and the
data position; only the shape of the batches changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from core.protocols import LoaderSpec


def seq_len_at(step: int, total_steps: int, base_seq_len: int, stages: list[Any]) -> int:
    """The sequence length at ``step`` (0-based): the last stage ``[fraction, seq_len]`` whose
    start ``fraction x total_steps`` is reached, else ``base_seq_len``."""
    seq = base_seq_len
    for start, stage_seq in stages:
        if step >= start * total_steps:
            seq = stage_seq
    return seq


def respec(spec: LoaderSpec, seq_len: int) -> LoaderSpec:
    """The loader spec of a new stage: the same tokens per micro-batch at ``seq_len``."""
    return dataclasses.replace(spec, seq_len=seq_len, micro_batch=spec.micro_batch * spec.seq_len // seq_len)
