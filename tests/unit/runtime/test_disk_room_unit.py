"""Room on the disk for the checkpoints, checked at the start (``core.train`` and ``core.plan``): a
checkpoint folder that cannot hold one checkpoint is bad input, before any training; one that cannot
hold what the run keeps at once is a warning. The real filesystem's free space."""

from __future__ import annotations

import math
import shutil

import pytest

from core.cli.plan import main


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
