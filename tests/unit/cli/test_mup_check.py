"""``plait mup-check``: the coordinate check of llama3 on CPU (widths 32, 64, 128, three AdamW steps on
the Shakespeare data): under standard parametrization the blocks' activations and their change grow
with width (slope of log RMS on log width near 1), under µP they stay flat, and the logits do not
grow; bad flags are one line, exit 2."""

from __future__ import annotations

import json

import pytest
from conftest import main_here, write_tiny_config

from core.cli.mup_check import main

pytestmark = pytest.mark.usefixtures("one_thread")

BODY = "[checkpoint]\nat_end = false\n[optimizer]\nlr = 1e-2\n"


def test_standard_grows_with_width_and_mup_stays_flat(tmp_path, capsys):
    cfg = write_tiny_config(tmp_path, body=BODY, global_batch_tokens=256, micro_batch=4)
    code, out, err = main_here(main, "--config", str(cfg), "--widths", "32,64,128", "--steps", "3", "--scale", "ffn_dim=3", "--json", "--data.seq_len=64")
    assert code == 0, err
    result = json.loads(out)
    standard, mup = result["standard"]["slopes"], result["mup"]["slopes"]
    blocks = [name for name in standard if name.startswith("block.")]
    assert blocks == ["block.0", "block.1"] and "logits" in standard
    for name in blocks:
        assert standard[name]["change"] > 0.8 and standard[name]["activation"] > 0.8, standard  # grows about as the width
        assert abs(mup[name]["change"]) < 0.35 and abs(mup[name]["activation"]) < 0.35, mup  # flat
    assert mup["logits"]["change"] < 0.1 < standard["logits"]["change"]  # µP's logits do not grow with width


def test_widths_must_increase_from_the_base(tmp_path):
    cfg = write_tiny_config(tmp_path, body=BODY)
    code, _, err = main_here(main, "--config", str(cfg), "--widths", "64,32")
    assert code == 2 and "--widths '64,32': expected two or more increasing widths, the first the base" in err
    assert len(err.strip().splitlines()) == 1
