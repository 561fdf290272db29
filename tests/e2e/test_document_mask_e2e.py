"""A run through ``core.train`` trains with the document mask."""

from __future__ import annotations


def test_a_run_trains_with_the_document_mask(tiny_config, tmp_path):
    from conftest import read_metrics, run_module

    cfg = tiny_config(steps=2)
    proc = run_module("core.train", "--config", str(cfg), "--model.attention_mask=document", "--model.rope_positions=document", "--parallelism.name=single")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)
