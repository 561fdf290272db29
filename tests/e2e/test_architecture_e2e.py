"""A resume never loads a checkpoint into a model whose architecture changed with every shape kept.

Before core/checkpoint/folders.py a resume with another ``model.n_heads`` (and ``n_kv_heads``:
the same shapes), ``tie_embeddings`` or ``norm_eps`` loaded, named only in the "config differs"
note, and trained another function from the saved weights. The model spec declares the options
that define its function (``architecture_options``, core/contract/members.py); ``rope_theta`` is not one
of them, so a context extension still resumes. Real runs, real DCP checkpoints, one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_here, run_module, write_tiny_config

from core.checkpoint import resume
from core.checkpoint.checkpointer import CheckpointDir
from core.checkpoint.folders import RESOLVED, check_architecture, run_architecture, saved_model_section
from core.config.sections import CheckpointOptions
from core.contract.errors import ConfigError
from core.contract.protocols import DistInfo
from model_specs.llama3.spec import Llama3Spec

pytestmark = pytest.mark.slow

REFUSED = "was saved with another model architecture"


# -- real runs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 4-step llama3 run (n_heads 4, n_kv_heads 2 from the debug flavor) with checkpoints of steps 2 and 4."""
    root = tmp_path_factory.mktemp("architecture")
    cfg = write_tiny_config(root, body="[checkpoint]\nevery = 2\n", steps=4)
    proc = run_module("core.train", "--config", str(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cfg


def copy_run(saved: Path, to: Path) -> Path:
    """The saved run copied to ``to`` (its config pointing at the copy)."""
    shutil.copytree(saved.parent / "out", to / "out")
    cfg = to / "run.toml"
    cfg.write_text(saved.read_text().replace(str(saved.parent / "out"), str(to / "out")))
    return cfg


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "plait.lock"}


def test_a_resume_with_other_heads_of_the_same_shapes_exits_2_with_one_line_and_plan_says_the_same(saved, tmp_path):
    cfg = copy_run(saved, tmp_path)
    before = files(tmp_path / "out" / "checkpoints")
    change = ("--model.n_heads=8", "--model.n_kv_heads=4")  # head dim 16 instead of 32: every tensor keeps its shape
    proc = run_module("core.train", "--config", str(cfg), "--train.steps=6", *change)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    newest = tmp_path / "out" / "checkpoints" / "step_000000004"
    assert line == (
        f"plait: error: checkpoint {newest} {REFUSED}: model.n_heads 4 -> 8, model.n_kv_heads 2 -> 4; its weights would compute "
        "another function in this model: change them back to resume from it, or train the new architecture from scratch in a "
        "fresh run folder (another train.output_dir)"
    )
    assert "training steps" not in proc.stdout  # refused before the model was built
    assert files(tmp_path / "out" / "checkpoints") == before
    plan = run_here("core.plan", "--config", str(cfg), "--train.steps=6", *change)
    assert plan.returncode == 2 and line in plan.stderr, plan.stderr[-3000:]


def test_a_resume_that_turns_on_qk_norm_is_refused_as_an_architecture_change(saved, tmp_path):
    """qk_norm adds weights the checkpoint lacks: one line, exit 2, before any step, that names the
    architecture change first and the missing weights after it."""
    cfg = copy_run(saved, tmp_path)
    before = files(tmp_path / "out" / "checkpoints")
    proc = run_module("core.train", "--config", str(cfg), "--train.steps=6", "--model.qk_norm=true")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "another model architecture: model.qk_norm False -> True; " in line, line
    assert "lacks model keys" in line and "attention.k_norm.weight" in line and "attention.q_norm.weight" in line, line
    assert "training steps" not in proc.stdout
    assert files(tmp_path / "out" / "checkpoints") == before
    newest = tmp_path / "out" / "checkpoints" / "step_000000004"
    section = saved_model_section(newest)
    assert section is not None and section[RESOLVED]["qk_norm"] is False
    with pytest.raises(ConfigError, match=r"another model architecture: model.qk_norm False -> True; "):
        spec = Llama3Spec.from_flavor("debug", dim=section["dim"], qk_norm=True)  # the saved run's shapes
        check_architecture(newest, run_architecture(spec, "llama3", {**section, "qk_norm": True}), explicit=True)


def test_a_resume_with_another_rope_theta_goes_on_and_names_it(saved, tmp_path):
    cfg = copy_run(saved, tmp_path)
    proc = run_module("core.train", "--config", str(cfg), "--train.steps=5", "--model.rope_theta=40000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout and REFUSED not in proc.stderr
    assert "model.rope_theta 0.0 -> 40000.0" in proc.stderr  # the config note still names it
    assert (tmp_path / "out" / "checkpoints" / "step_000000005" / "COMMITTED").is_file()


def in_process_prepare(cfg: Path, *overrides: str):
    from core.preflight.prepare import prepare

    return prepare(str(cfg), list(overrides), world_size=1, dry_run=True)


def test_an_explicit_resume_and_initial_load_of_another_architecture_are_refused(saved, tmp_path):
    step2 = saved.parent / "out" / "checkpoints" / "step_000000002"
    fresh = write_tiny_config(tmp_path)
    with pytest.raises(ConfigError) as e:
        in_process_prepare(fresh, f"--checkpoint.resume={step2}", "--model.tie_embeddings=true")
    assert f"checkpoint {step2} {REFUSED}: model.tie_embeddings False -> True" in str(e.value)  # the flavor's, resolved
    assert "change it back to resume from it" in str(e.value) and "checkpoint.resume left out)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        in_process_prepare(fresh, f"--checkpoint.initial_load={step2}", "--model.norm_eps=1e-6")
    assert str(e.value) == (
        f"checkpoint.initial_load {step2} {REFUSED}: model.norm_eps 1e-05 -> 1e-06; its weights would compute another function in "
        "this model: change it back to start from its weights, or leave checkpoint.initial_load out"
    )
    assert not (tmp_path / "out").exists()  # nothing made for a refused start
    in_process_prepare(fresh, f"--checkpoint.resume={step2}", "--model.rope_theta=40000")  # a context extension is fine
    in_process_prepare(fresh, f"--checkpoint.resume={step2}", "--model.norm_eps=1e-6", '--checkpoint.exclude_from_loading=["model"]')  # no weights loaded


def test_a_fallback_to_an_older_checkpoint_of_another_architecture_is_refused(saved, tmp_path):
    """``resume = "auto"`` falls back past a newest checkpoint whose shards are damaged: the older one
    is held to this run's architecture too (a run that changed it on an earlier resume, weights left
    out, has checkpoints of both)."""
    cfg = copy_run(saved, tmp_path)
    root = tmp_path / "out" / "checkpoints"
    step2, step4 = root / "step_000000002", root / "step_000000004"
    shard = next(step4.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only its checksum sees it
    shard.write_bytes(bytes(data))
    section = saved_model_section(step2)
    assert section is not None and cfg.is_file()
    ckpt = CheckpointDir(CheckpointOptions(), root, DistInfo(), control=None)
    same = run_architecture(Llama3Spec.from_flavor("debug", dim=64, n_layers=2), "llama3", section)  # the spec the section builds
    assert resume.first_sound(ckpt, [step4, step2], None, same) == (step2, [])  # the fallback itself
    other = run_architecture(Llama3Spec.from_flavor("debug", dim=64, n_layers=2, norm_eps=1e-6), "llama3", {**section, "norm_eps": 1e-6})
    with pytest.raises(ConfigError, match=f"checkpoint {step2} {REFUSED}: model.norm_eps 1e-05 -> 1e-06"):
        resume.first_sound(ckpt, [step4, step2], None, other)


def test_a_resume_that_writes_out_the_flavors_value_goes_on_and_another_value_is_refused(saved, tmp_path):
    """The checkpoint recorded n_heads 4 (the debug flavor's, written ``n_heads = 0``): a resume that
    writes ``n_heads = 4`` is the same architecture and goes on."""
    cfg = copy_run(saved, tmp_path)
    step4 = tmp_path / "out" / "checkpoints" / "step_000000004"
    recorded = json.loads((step4 / "state.json").read_text())["architecture"]
    assert recorded["n_heads"] == 0 and recorded[RESOLVED]["n_heads"] == 4 and recorded[RESOLVED]["n_kv_heads"] == 2
    proc = run_module("core.train", "--config", str(cfg), "--train.steps=5", "--model.n_heads=4", "--model.n_kv_heads=2")
    assert proc.returncode == 0 and REFUSED not in proc.stderr, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    step5 = tmp_path / "out" / "checkpoints" / "step_000000005"
    assert json.loads((step5 / "state.json").read_text())["architecture"][RESOLVED]["n_heads"] == 4


def test_a_recurrent_moe_resume_compares_resolved_values(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=2).read_text().replace('name = "llama3"\nflavor = "debug"\ndim = 64\nn_layers = 2\n', 'name = "recurrent_moe"\n')
    (tmp_path / "run.toml").write_text(cfg)
    first = run_module("core.train", "--config", str(tmp_path / "run.toml"))
    assert first.returncode == 0, first.stderr[-3000:]
    same = run_here("core.plan", "--config", str(tmp_path / "run.toml"), "--train.steps=3", "--model.top_k=2", "--model.n_loops=3")
    assert same.returncode == 0, same.stderr[-3000:]  # the debug flavor's own values, written out
    other = run_here("core.plan", "--config", str(tmp_path / "run.toml"), "--train.steps=3", "--model.top_k=1")
    assert other.returncode == 2 and f"{REFUSED}: model.top_k 2 -> 1;" in other.stderr, other.stderr[-3000:]
