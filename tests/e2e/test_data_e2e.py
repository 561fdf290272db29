"""Data over real runs: seq_len stages keep the tokens per step; validation runs, is refused without a
validation split, reports its loss per mixture source, and keeps the best checkpoints through pruning."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO, read_metrics, run_module
from shared import write

STAGES = '--monitors.enabled=["console", "jsonl", "seq_len_stages"]'


def test_seq_len_stages_keep_tokens_per_step(tiny_config, tmp_path):
    cfg = tiny_config(steps=6)  # data.seq_len 128: 512 tokens per micro-batch of 4
    stages = "--monitors.seq_len_stages.stages=[[0.0, 64], [0.5, 128]]"
    proc = run_module("core.train", "--config", str(cfg), "--train.micro_batch=4", "--train.global_batch_tokens=512", STAGES, stages)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_metrics(tmp_path / "out")
    assert [r["seq_len"] for r in rows] == [64, 64, 64, 128, 128, 128]
    assert [r["tokens_seen"] for r in rows] == [512 * s for s in range(1, 7)]
    assert "step 1: sequence length 64, micro-batch 8 (stage change)" in proc.stdout
    assert "step 4: sequence length 128, micro-batch 4 (stage change)" in proc.stdout
    bad = run_module("core.train", "--config", str(cfg), "--train.micro_batch=2", STAGES, "--monitors.seq_len_stages.stages=[[0.0, 64], [0.5, 96]]")
    assert (
        bad.returncode == 2
        and "monitor 'seq_len_stages': sequence-length schedule: sequence length 96 does not divide the micro-batch's 256 tokens" in bad.stderr
    )
    bad = run_module("core.train", "--config", str(cfg), STAGES, "--monitors.seq_len_stages.stages=[[0.5, 64], [0.2, 32]]")
    assert bad.returncode == 2 and "start fractions must rise" in bad.stderr
    longest = ["--train.micro_batch=64", "--train.global_batch_tokens=8192", "--monitors.seq_len_stages.stages=[[0.5, 8192]]"]
    bad = run_module("core.train", "--config", str(cfg), STAGES, *longest)
    assert bad.returncode == 2 and "the sequence-length schedule's length 8192 exceeds the model's max_seq_len" in bad.stderr


def test_validation_runs_and_keeps_best(tiny_config, tmp_path):
    cfg = tiny_config(steps=6)
    proc = run_module("core.train", "--config", str(cfg), "--validation.every=3", "--validation.batches=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    vals = read_metrics(tmp_path / "out", kind="val")
    assert [v["step"] for v in vals] == [3, 6]
    assert vals[1]["best_val_loss"] == min(v["val_loss"] for v in vals)
    state = json.loads((tmp_path / "out" / "checkpoints" / "step_000000006" / "state.json").read_text())
    assert state["train"]["best_val_loss"] == vals[1]["best_val_loss"]


def test_validation_without_val_split_is_an_error(tiny_config, tmp_path):
    d = tmp_path / "noval"
    write(d / "train.bin", np.arange(5000) % 200)
    proc = run_module("core.train", "--config", str(tiny_config()), f"--data.path={d}", "--validation.every=2")
    assert proc.returncode == 2 and "no 'val' split" in proc.stderr


def test_keep_best_checkpoints_survive_pruning(tiny_config, tmp_path):
    cfg = tiny_config(steps=8)
    proc = run_module(
        "core.train",
        "--config",
        str(cfg),
        "--validation.every=2",
        "--validation.batches=2",
        '--monitors.enabled=["console", "jsonl", "spike_rehearsal"]',
        "--monitors.spike_rehearsal.at_step=5",
        "--optimizer.lr=1e-2",
        "--checkpoint.every=1",
        "--checkpoint.keep_latest=1",
        "--checkpoint.keep_best=2",
        "--checkpoint.keep_lowest_loss=false",  # keep_best alone (tests/e2e/test_retention.py has the lowest-loss rule)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    vals = sorted(read_metrics(tmp_path / "out", kind="val"), key=lambda v: v["val_loss"])
    root = tmp_path / "out" / "checkpoints"
    best = json.loads((root / "BEST.json").read_text())["best"]
    assert [b["step"] for b in best] == [v["step"] for v in vals[:2]]  # the top 2 by validation loss, best first
    assert best[0]["val_loss"] == pytest.approx(vals[0]["val_loss"])
    kept = sorted(p.name for p in root.glob("step_*"))
    assert kept == sorted({b["path"] for b in best} | {"step_000000008"})  # the latest, and the best through pruning
    assert all((root / b["path"] / "COMMITTED").exists() for b in best)


PER_SOURCE_SCRIPT = """
import json, sys
import numpy as np, torch
from core.runtime import distributed
from core.preflight.prepare import prepare
from core.loop.trainer import Trainer
from core.loop.validation import evaluate

prep = prepare(sys.argv[1], [])
info = distributed.init(prep.rc.train.device)
trainer = Trainer(prep, info)
trainer.build()
opts = prep.rc.sections["validation"]
seeds_before = [trainer.c["data"].seed] + [s.seed for s in trainer.c["data"].sources]  # what the training stream draws with
loss = evaluate(trainer, opts)
seeds_after = [trainer.c["data"].seed] + [s.seed for s in trainer.c["data"].sources]
seq, micro = trainer.loader_spec.seq_len, trainer.loader_spec.micro_batch
with torch.no_grad():  # the whole model on one constant sequence: every window of that source is this one
    direct = {t: trainer.model(torch.full((1, seq), t), torch.full((1, seq), t)).item() for t in (7, 9)}
picks = trainer.c["data"].choose(np.arange(opts.batches * micro * info.world_size))  # every rank's validation rows
if info.is_main:
    json.dump({"loss": float(loss), "type": type(loss).__name__, "parts": loss.parts, "direct": direct,
               "rows_a": int((picks == 0).sum()), "rows_b": int((picks == 1).sum()), "world": info.world_size,
               "seeds_kept": seeds_before == seeds_after}, open(sys.argv[2], "w"))
trainer = None
distributed.shutdown()
"""


def test_mixture_reports_validation_loss_per_source(tmp_path):
    """Two token_bin sources of one repeated id each (7 and 9), mixed 0.7/0.3, evaluated on 2 gloo ranks:
    val_loss/<label> is the model's loss on that source's sequence, and val_loss the row-weighted mean."""

    from conftest import torchrun_script

    for label, tok in (("sevens", 7), ("nines", 9)):
        write(tmp_path / label / "train.bin", np.full(4000, tok))
        write(tmp_path / label / "val.bin", np.full(2000, tok))
        (tmp_path / label / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 257, "tokenizer_fingerprint": "bytes"}))
    cfg = tmp_path / "mix.toml"
    cfg.write_text(f'''
extends = "{REPO / "train_configs" / "base.toml"}"
[train]
steps = 2
global_batch_tokens = 256
micro_batch = 2
output_dir = "{tmp_path / "out"}"
device = "cpu"
[model]
name = "llama3"
flavor = "debug"
dim = 64
n_layers = 2
[data]
name = "mixture"
seq_len = 32
sources = [
  {{name = "token_bin", weight = 0.7, label = "sevens", path = "{tmp_path / "sevens"}"}},
  {{name = "token_bin", weight = 0.3, label = "nines", path = "{tmp_path / "nines"}", order = "epochs"}},
]
[precision]
name = "fp32"
[validation]
every = 1
batches = 3
[monitors]
enabled = []
''')
    (tmp_path / "script.py").write_text(PER_SOURCE_SCRIPT)
    out = tmp_path / "result.json"
    proc = torchrun_script(2, tmp_path / "script.py", str(cfg), str(out), timeout=240, extra_env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world"] == 2 and r["type"] == "ValidationLoss" and r["seeds_kept"]
    assert sorted(r["parts"]) == ["val_loss/nines", "val_loss/sevens"]
    sevens, nines = r["direct"]["7"], r["direct"]["9"]
    assert abs(sevens - nines) > 1e-3  # the two sources really differ for this model
    assert r["parts"]["val_loss/sevens"] == pytest.approx(sevens, rel=1e-5)
    assert r["parts"]["val_loss/nines"] == pytest.approx(nines, rel=1e-5)
    assert 0 < r["rows_b"] < r["rows_a"]
    assert r["loss"] == pytest.approx((r["rows_a"] * sevens + r["rows_b"] * nines) / (r["rows_a"] + r["rows_b"]), rel=1e-5)
