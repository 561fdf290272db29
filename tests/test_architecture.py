"""A resume never loads a checkpoint into a model whose architecture changed with every shape kept.

Before core/checkpoint/architecture.py a resume with another ``model.n_heads`` (and ``n_kv_heads``:
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
from core.checkpoint.architecture import RESOLVED, differences, run_architecture, saved_model_section
from core.checkpoint.checkpointer import CheckpointDir
from core.config.sections import CheckpointOptions
from core.contract.errors import ConfigError, PluginError
from core.contract.members import check_component
from core.contract.protocols import DistInfo
from model_specs.llama3.spec import Llama3Spec
from model_specs.recurrent_moe.spec import RecurrentMoEOptions, RecurrentMoESpec

pytestmark = pytest.mark.slow

REFUSED = "was saved with another model architecture"
SECTION = {"name": "llama3", "flavor": "debug", "n_heads": 0, "n_kv_heads": 0, "norm_eps": 1e-5, "tie_embeddings": "flavor", "rope_theta": 0.0}


class Declares:
    architecture_options = ("n_heads", "n_kv_heads", "norm_eps", "tie_embeddings")


# -- the comparison ---------------------------------------------------------------------------


def test_the_run_architecture_is_the_name_and_the_declared_options_as_saved():
    assert run_architecture(Declares(), "llama3", SECTION) == {"name": "llama3", "n_heads": 0, "n_kv_heads": 0, "norm_eps": 1e-5, "tie_embeddings": "flavor"}
    assert run_architecture(object(), "llama3", SECTION) is None  # declares nothing: shapes only, as before
    lists = type("Lists", (), {"architecture_options": ("layers",)})()
    assert run_architecture(lists, "m", {"name": "m", "layers": (1, 2)}) == {"name": "m", "layers": [1, 2]}  # as JSON reads it back


def test_a_difference_names_each_changed_option_and_nothing_else():
    now = run_architecture(Declares(), "llama3", {**SECTION, "n_heads": 8, "n_kv_heads": 4, "rope_theta": 5e5})
    assert differences(SECTION, now) == [("n_heads", 0, 8), ("n_kv_heads", 0, 4)]  # rope_theta is not declared
    assert differences({**SECTION, "n_heads": 8, "n_kv_heads": 4}, now) == []
    older = {k: v for k, v in SECTION.items() if k != "norm_eps"}  # an option the plugin added since: not compared
    assert differences(older, run_architecture(Declares(), "llama3", {**SECTION, "norm_eps": 1e-6})) == []
    # another model: the one difference (its options are another plugin's)
    assert differences({"name": "recurrent_moe", "flavor": "debug"}, now) == [("name", "recurrent_moe", "llama3")]


@pytest.mark.parametrize(
    "declared, words",
    [
        (["n_heads"], "must be a tuple of option names, got ['n_heads']"),
        (("n_head",), "names 'n_head', which is not one of its [model] options (flavor, n_heads,"),
        (("name",), "names 'name', which is not one of its [model] options"),
    ],
)
def test_a_malformed_declaration_is_the_plugins_one_line_error(declared, words):
    spec = type("Spec", (), {"architecture_options": declared})()
    with pytest.raises(PluginError) as e:
        run_architecture(spec, "mine", SECTION)
    assert f"model plugin 'mine': architecture_options {words}" in str(e.value) and "\n" not in str(e.value)


def test_the_contract_declares_architecture_options_a_tuple_and_the_builtin_specs_name_real_options():
    class ListDeclared(Llama3Spec):
        architecture_options = ["n_heads"]  # type: ignore[assignment]

    with pytest.raises(PluginError, match="architecture_options must be tuple"):
        check_component("model", "mine", ListDeclared.from_flavor("debug"))
    from dataclasses import asdict

    from model_specs.llama3.spec import Llama3Options

    llama = run_architecture(Llama3Spec.from_flavor("debug"), "llama3", {"name": "llama3", **asdict(Llama3Options())})
    assert llama is not None and {"n_heads", "n_kv_heads", "tie_embeddings", "norm_eps"} <= set(llama)
    assert not {"rope_theta", "max_seq_len", "attention", "loss_chunk_tokens", "init_std"} & set(llama)  # may change on purpose
    moe = run_architecture(RecurrentMoESpec.from_options(RecurrentMoEOptions()), "recurrent_moe", {"name": "recurrent_moe", **asdict(RecurrentMoEOptions())})
    assert moe is not None and {"n_loops", "top_k", "n_experts"} <= set(moe) and not {"aux_weight", "z_weight"} & set(moe)


def test_core_plugins_shows_each_models_architecture_options():
    from core.cli.plugins import render

    text = render("model")
    assert "architecture (a resume from a checkpoint saved with other values is refused): flavor, n_layers, dim, n_heads, n_kv_heads" in text
    assert "refused): flavor, n_loops, n_experts, top_k, vocab_size" in text


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


# -- resolved values (resolved_architecture) ---------------------------------------------------


def test_the_flavors_own_value_written_out_is_the_same_architecture_in_process():
    """``n_heads = 0`` (the flavor's 4) and ``n_heads = 4`` differ as written; built, they are the same."""
    from dataclasses import asdict

    from model_specs.llama3.spec import Llama3Options

    def arch(**o):
        return run_architecture(Llama3Spec.from_flavor("debug", **o), "llama3", {"name": "llama3", **asdict(Llama3Options(**o))})

    written, out = arch(), arch(n_heads=4, n_kv_heads=2)
    assert written is not None and out is not None and written[RESOLVED]["n_heads"] == out[RESOLVED]["n_heads"] == 4
    assert differences({k: v for k, v in written.items()}, out) == []  # a checkpoint that recorded its resolved values
    # one saved before (no resolved values): compared as written, as before
    assert differences({k: v for k, v in written.items() if k != RESOLVED}, out) == [("n_heads", 0, 4), ("n_kv_heads", 0, 2)]
    assert differences(written, arch(n_heads=8, n_kv_heads=4)) == [("n_heads", 4, 8), ("n_kv_heads", 2, 4)]

    def moe(**o):
        opts = RecurrentMoEOptions(**o)
        return run_architecture(RecurrentMoESpec.from_options(opts), "recurrent_moe", {"name": "recurrent_moe", **asdict(opts)})

    assert differences(moe(), moe(top_k=2, n_experts=4, n_loops=3)) == []  # the debug flavor's own values
    assert differences(moe(), moe(top_k=1)) == [("top_k", 2, 1)]


@pytest.mark.parametrize(
    "answer, words",
    [
        (["n_heads"], "resolved_architecture() returned list; expected {name: value} with string names"),
        ({"n_heads": object()}, "resolved_architecture() returned a value that is not JSON"),
    ],
)
def test_a_malformed_resolved_architecture_is_the_plugins_one_line_error(answer, words):
    spec = type("Spec", (), {"architecture_options": ("n_heads",), "resolved_architecture": lambda self: answer})()
    with pytest.raises(PluginError) as e:
        run_architecture(spec, "mine", SECTION)
    assert f"model plugin 'mine': {words}" in str(e.value) and "\n" not in str(e.value)


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
