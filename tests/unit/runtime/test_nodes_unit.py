"""A collective broken by a lost or silent peer (also inside a DCP save's CheckpointException, or as
the cause of another error) is explained in one line naming the last complete checkpoint; any other
error keeps its own traceback."""

from __future__ import annotations


def test_only_a_collective_broken_by_a_lost_rank_is_explained_as_one(tmp_path):
    """The line is for what gloo says when the other end is gone or silent, also inside a DCP save's
    CheckpointException or as the cause of another error; any other error (a bug, a full disk) keeps
    its own traceback and exit_status.json detail."""
    from torch.distributed.checkpoint.api import CheckpointException

    from core.loop.lost_peer import PeerLost, explain

    (tmp_path / "step_000000004").mkdir()
    (tmp_path / "step_000000004" / "COMMITTED").write_text("{}")

    def said(error: BaseException) -> str | None:
        found = explain(error, 3, "saving the checkpoint of step 6 (writing its files)", tmp_path, 7)
        return str(found) if found is not None else None

    gone = RuntimeError("[../pair.cc:100] Socket closed [10.0.0.2]:41234. This is typically caused by a remote worker crashing.")
    line = said(CheckpointException("save failed", {1: (gone, None)}))  # type: ignore[dict-item]
    assert line == (
        "rank 3: another rank is gone (Socket closed [10.0.0.2]:41234) while this one was saving the checkpoint of step 6 "
        f"(writing its files): a node, or a process of it, was lost; this rank ends too, and a launcher restarts the run "
        f"from the last complete checkpoint, {tmp_path / 'step_000000004'}"
    ), line
    silent = RuntimeError("[../unbound_buffer.cc:81] Timed out waiting 7000ms for recv operation to complete")
    wrapped = ValueError("the step failed")
    wrapped.__cause__ = silent
    assert said(wrapped).startswith("rank 3: another rank did not answer within train.collective_timeout_s = 7 s (Timed out waiting 7000ms for recv")
    assert said(RuntimeError("CUDA error: an illegal memory access was encountered")) is None
    assert said(OSError(28, "No space left on device")) is None and said(KeyboardInterrupt()) is None
    assert isinstance(explain(PeerLost("x"), 0, "", tmp_path, 1), PeerLost)
