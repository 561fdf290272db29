"""A resumed run trains with its own config's optimizer settings, not the checkpoint's, and says which changed.

Before core/checkpoint/hyperparams.py, DCP's optimizer load restored every param-group setting as saved:
``--optimizer.lr=...`` on a resumed run was silently ignored, and a checkpoint saved with
``impl = "foreach"`` crashed a resume under the fused default (``found_inf`` reached the foreach kernel).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO


def stream_docs(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum " * 9}) + "\n" for i in range(200)))
    return path


def test_a_mixture_refuses_a_checkpoint_of_other_stages_or_without_its_streams_positions(tmp_path):
    """The mixture's own word before training (core.train and core.plan), where its load said it only
    after the model was built (and that error, too, was taken for damage)."""
    from core.contract.errors import DataError
    from plugins.data.mixture import Mixture, MixtureOptions

    corpus = str(REPO / "plugins" / "data" / "corpus" / "shakespeare")
    indexed = [{"name": "token_bin", "weight": 1.0, "path": corpus}, {"name": "synthetic", "weight": 1.0}]
    staged = Mixture(MixtureOptions(sources=indexed, stages=[(0.0, [1.0, 0.0]), (0.3, [0.5, 0.5]), (0.6, [0.0, 1.0])]))
    with pytest.raises(DataError, match=r"the checkpoint's data position has 2 stage\(s\), this config 3"):
        staged.check_resume({"world_size": 1, "data": {"consumed_samples": 48, "stage_starts": [0, 24]}}, 1)
    staged.check_resume({"world_size": 1, "data": {"consumed_samples": 48, "stage_starts": [0, 24, 30]}}, 1)
    streaming = Mixture(MixtureOptions(sources=[indexed[0], {"name": "text_stream", "weight": 1.0, "files": [str(stream_docs(tmp_path))]}]))
    with pytest.raises(DataError, match="the checkpoint holds a global data position of data source 'token_bin'"):
        streaming.check_resume({"world_size": 1, "data": {"consumed_samples": 48}, "config": {"data": {"name": "token_bin"}}}, 1)
    streaming.check_resume({"world_size": 1, "data": {}}, 1)
