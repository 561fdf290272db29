"""``plait mup-check``: the coordinate check of llama3 and recurrent_moe on CPU (widths 32, 64, 128,
three AdamW steps on the Shakespeare data): under standard parametrization the blocks' activations
and their change grow with width (slope of log RMS on log width near 1 for llama3, 0.6-0.8 for
recurrent_moe), under µP they stay flat, and the logits do not grow; bad flags are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import main_here, write_tiny_config

from core.cli.mup_check import main

pytestmark = pytest.mark.usefixtures("one_thread")

BODY = "[checkpoint]\nat_end = false\n[optimizer]\nlr = 1e-2\n"


MOE = """
extends = "{repo}/train_configs/recurrent_moe_debug.toml"
[train]
global_batch_tokens = 256
micro_batch = 4
output_dir = "{out}"
[data]
path = "{repo}/plugins/data/corpus/shakespeare"
[optimizer]
lr = 1e-2
"""


@pytest.mark.parametrize(("model", "blocks", "grows"), [("llama3", 2, 0.8), ("recurrent_moe", 3, 0.5)])
def test_standard_grows_with_width_and_mup_stays_flat(tmp_path, model, blocks, grows):
    if model == "llama3":
        cfg, scale = write_tiny_config(tmp_path, body=BODY, global_batch_tokens=256, micro_batch=4), "ffn_dim=3"
    else:
        cfg, scale = tmp_path / "moe.toml", "ffn_dim=2"
        cfg.write_text(MOE.format(repo=Path(__file__).resolve().parents[3], out=tmp_path / "out"))
    code, out, err = main_here(main, "--config", str(cfg), "--widths", "32,64,128", "--steps", "3", "--scale", scale, "--json", "--data.seq_len=64")
    assert code == 0, err
    result = json.loads(out)
    standard, mup = result["standard"]["slopes"], result["mup"]["slopes"]
    assert [name for name in standard if name.startswith("block.")] == [f"block.{i}" for i in range(blocks)] and "logits" in standard
    for name in (f"block.{i}" for i in range(blocks)):
        assert standard[name]["change"] > grows and standard[name]["activation"] > grows, standard  # grows with the width
        assert abs(mup[name]["change"]) < 0.35 and abs(mup[name]["activation"]) < 0.35, mup  # flat
    assert mup["logits"]["change"] < 0.1 < standard["logits"]["change"]  # µP's logits do not grow with width


def test_widths_must_increase_from_the_base(tmp_path):
    cfg = write_tiny_config(tmp_path, body=BODY)
    code, _, err = main_here(main, "--config", str(cfg), "--widths", "64,32")
    assert code == 2 and "--widths '64,32': expected two or more increasing widths, the first the base" in err
    assert len(err.strip().splitlines()) == 1
