"""Room on the disk for the checkpoints, checked at the start (``core.train`` and ``core.plan``): a
checkpoint folder that cannot hold one checkpoint is bad input, before any training; one that
cannot hold what the run keeps at once is a warning, rather than a disk found too small at the first
save, hours in. The real filesystem's free space."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from core.cli.plan import main
from tests.conftest import PY, in_a_small_disk


def test_a_checkpoint_folder_without_room_for_one_checkpoint_is_refused_at_the_start(tiny_config, tmp_path, capsys):
    free = shutil.disk_usage(tmp_path).free
    per_layer = 3 * 16384**2 * (4 + 8)  # a debug-flavor llama3 layer holds > 3 d^2 parameters; fp32 weights + AdamW's moments
    layers = math.ceil(2 * free / per_layer) + 1
    with pytest.raises(SystemExit) as e:
        main(["--config", str(tiny_config()), "--model.dim=16384", f"--model.n_layers={layers}"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"plait: error: [checkpoint].dir = {tmp_path / 'out' / 'checkpoints'}: ") and "free on its filesystem" in line, line
    assert "one checkpoint of this run needs about" in line and "point checkpoint.dir elsewhere" in line, line
    assert not (tmp_path / "out").exists()  # a plan creates nothing


def test_a_disk_that_fills_before_the_run_ends_is_a_warning(tiny_config, capsys):
    """keep_latest = 0 keeps every save: a hundred million of them do not fit."""
    assert main(["--config", str(tiny_config()), "--checkpoint.keep_latest=0", "--checkpoint.every=1", "--train.steps=100000000"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("plait: warning: [checkpoint].dir")]
    assert len(warnings) == 1 and "this run keeps up to 100,000,001 at once: the disk may fill before the run ends" in warnings[0], warnings


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
    """The start's write probe failed after creating its (empty) file, and left it in the user's folder."""
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
