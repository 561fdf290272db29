"""What a long run must not accumulate: per-save work that grows with the checkpoints kept, and
(bench/soak.py measures the rest over thousands of steps) the structures, threads and file
descriptors a run holds. Each test runs plait's own Trainer in-process on one CPU process for a
few seconds, with real DCP checkpoints and real files."""

from __future__ import annotations

from pathlib import Path

from conftest import write_tiny_config
from shared import trainer_for


def test_keeping_every_checkpoint_does_not_make_each_save_verify_them_all(tmp_path, monkeypatch):
    """checkpoint.keep_latest = 0 keeps every checkpoint: the prune after each commit must not verify
    all of them (manifest, sizes, small files' checksums, DCP metadata), or each save would take
    longer than the one before, without end."""
    from core.checkpoint import retention

    cfg = write_tiny_config(tmp_path, steps=100, body="[checkpoint]\nkeep_latest = 0\nat_end = false\n")
    t = trainer_for(cfg)
    verified: list[str] = []
    real = retention.verify

    def counting(path, shards=True):
        verified.append(Path(path).name)
        return real(path, shards)

    monkeypatch.setattr(retention, "verify", counting)
    for step in range(1, 13):
        t.run.step = step
        verified.clear()
        t.checkpointer.save(step, use_async=False)
    assert len(list((tmp_path / "out" / "checkpoints").glob("step_*/COMMITTED"))) == 12  # all kept
    assert verified == ["step_000000012"], verified  # the newest only, not the twelve
