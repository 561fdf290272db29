"""The disk filling under real runs: a disk with room for ``keep_latest`` checkpoints but not one more
saves every time, an output folder on a full disk is one line and leaves nothing behind, and a full disk
under TensorBoard is one warning, then the exit 74 line at the save that finds no room. Real filesystems
of fixed size."""

from __future__ import annotations

import json

import pytest

from tests.conftest import PY, in_a_small_disk

VERIFY = """
import json, sys
from pathlib import Path
from core.checkpoint.folders import committed, step_dirs, verify
root = Path(sys.argv[1])
print(json.dumps({"dirs": [p.name for p in step_dirs(root)], "verified": [verify(p)["step"] for p in committed(root)]}))
"""


def test_a_disk_with_room_for_keep_latest_checkpoints_but_not_one_more_saves_every_time(tiny_config, tmp_path):
    """A checkpoint of this model takes about 3.1 MB; the disk holds two. keep_latest = 2 needs a third
    while each save is written (pruning follows the commit), so the oldest, which that prune would
    remove, goes first and the third save fits."""
    disk = tmp_path / "disk"
    disk.mkdir()
    body = f'[checkpoint]\ndir = "{disk}"\nevery = 1\nkeep_latest = 2\nkeep_lowest_loss = false\n'
    config = tiny_config(body=body, steps=5)
    script = f'{PY} -m core.train --config "{config}"; rc=$?; {PY} -c \'{VERIFY}\' "{disk}"; exit $rc'
    done = in_a_small_disk("8m", disk, script)
    if done is None:
        pytest.skip("this machine may not mount a tmpfs, even in a namespace of its own (unshare -m / -rm)")
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"dirs": ["step_000000004", "step_000000005"], "verified": [4, 5]}, found
    early = [line for line in done.stderr.splitlines() if "before the save of step" in line]
    assert len(early) == 3 and "step_000000001" in early[0] and "before the save of step 3" in early[0], early
    assert "still short of room" not in done.stderr


def test_an_output_folder_on_a_full_disk_is_one_line_and_leaves_nothing_behind(tiny_config, tmp_path):
    """A start on a full disk is one line, and its write probe leaves no file in the user's folder."""
    out = tmp_path / "out"
    out.mkdir()
    script = f'dd if=/dev/zero of="{out}/filler" bs=4k 2>/dev/null; {PY} -m core.train --config "{tiny_config()}"; rc=$?; ls -A "{out}"; exit $rc'
    done = in_a_small_disk("1m", out, script)
    if done is None:
        pytest.skip("this machine may not mount a tmpfs, even in a namespace of its own (unshare -m / -rm)")
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("plait: error:")]
    assert errors == [
        f"plait: error: [train].output_dir = {out}: cannot create or write a file there (OSError: No space left on device); expected a writable folder"
    ], errors
    assert done.stdout.split() == ["filler"], done.stdout


def test_a_full_disk_under_tensorboard_is_one_warning_and_the_exit_74_line_no_traceback(tiny_config, tmp_path):
    """The output folder's disk fills during the run: first its ``tensorboard`` folder (a 4 KiB disk of
    its own, full after a few logged steps), then its checkpoints (room for two of three). The monitor
    warns once and writes no more events, and the run ends at the save that finds no room: exit 74, one
    error line, no traceback."""
    out = tmp_path / "out"
    out.mkdir()
    config = tiny_config(body="[checkpoint]\nevery = 5\nkeep_latest = 3\nkeep_lowest_loss = false\n", steps=20)
    config.write_text(config.read_text().replace('enabled = ["console", "jsonl"]', 'enabled = ["console", "jsonl", "tensorboard"]', 1))
    board = out / "tensorboard"
    script = (
        f'mkdir "{board}" && mount -t tmpfs -o size=4k tmpfs "{board}" && {PY} -m core.train --config "{config}"; rc=$?; cat "{out}/exit_status.json"; exit $rc'
    )
    done = in_a_small_disk("8m", out, script)
    if done is None:
        pytest.skip("this machine may not mount a tmpfs, even in a namespace of its own (unshare -m / -rm)")
    assert done.returncode == 74, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception in thread" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("plait: error:")]
    assert len(errors) == 1 and "checkpoint save at step 15 failed" in errors[0] and "exit code 74" in errors[0], errors
    board_lines = [line for line in done.stderr.splitlines() if "'tensorboard'" in line]
    assert len(board_lines) == 1 and board_lines[0].startswith("plait: warning: monitor 'tensorboard': cannot write ") and "ENOSPC" in board_lines[0], (
        board_lines
    )
    status = json.loads(done.stdout.strip().splitlines()[-1])
    assert status["exit_code"] == 74 and status["reason"] == "save_failed" and status["step"] == 15, status
