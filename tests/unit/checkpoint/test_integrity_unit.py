"""The fsync DCP asks for covers the whole shard written through plait's checksumming stream."""

from __future__ import annotations

import os


def test_the_fsync_dcp_asks_for_covers_the_whole_shard(tmp_path):
    """DCP fsyncs ``stream.fileno()`` before closing the stream; the checksumming stream hands over
    its file descriptor only once everything written through it is in the file, so the fsync covers
    the shard's tail too (a crash after the commit never finds a short shard)."""
    from core.checkpoint.safe_dcp import _ChecksummingFileSystem

    fs = _ChecksummingFileSystem()
    path = tmp_path / "__0_0.distcp"
    with fs.create_stream(path, "wb") as stream:
        stream.write(b"x" * 100)  # small: it stays in the file object's buffer until flushed
        fd = stream.fileno()
        assert os.fstat(fd).st_size == 100
    assert path.stat().st_size == 100 and set(fs.checksums) == {path.name}
