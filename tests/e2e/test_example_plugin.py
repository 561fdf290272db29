"""The example third-party distribution installs, is discovered, and trains from a TOML that names it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, flat_checkpoint, read_metrics, run_module, write_tiny_config


@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(REPO / "examples" / "plait-example-plugin"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return {"PYTHONPATH": str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_listed_with_its_distribution(example_site):
    proc = run_module("core.plugins", extra_env=example_site)
    assert proc.returncode == 0, proc.stderr
    assert "lion" in proc.stdout and "[from plait-example-plugin, plugin 'example']" in proc.stdout
    assert "loss_target" in proc.stdout and "stop once the logged training loss is below this value" in proc.stdout


@pytest.fixture(scope="module")
def lion_run(example_site, tmp_path_factory):
    """A run with the example's optimizer (lion) and monitor (loss_target, which stops it once the loss
    is below 3.6): (the finished process, its output folder)."""
    tmp = tmp_path_factory.mktemp("lion")
    cfg = write_tiny_config(tmp, steps=40, body=('[optimizer]\nname = "lion"\nlr = 2e-3\n[monitors.loss_target]\ntarget = 3.6\n'))
    proc = run_module("core.train", "--config", str(cfg), '--monitors.enabled=["console", "jsonl", "loss_target"]', extra_env=example_site)
    return proc, tmp / "out"


@pytest.fixture(scope="module")
def hidden_run(example_site, tmp_path_factory):
    """``core.train`` naming the example's optimizer under ``PLAIT_PLUGINS=""`` (which loads no third-party plugin)."""
    cfg = write_tiny_config(tmp_path_factory.mktemp("hidden"))
    return run_module("core.train", "--config", str(cfg), "--optimizer.name=lion", extra_env={**example_site, "PLAIT_PLUGINS": ""})


def test_trains_with_third_party_optimizer_and_monitor(lion_run):
    proc, out = lion_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert rows[-1]["loss"] < 3.6 and rows[-1]["step"] < 40  # the monitor stopped the run early
    assert "loss_target" not in proc.stderr
    assert "checkpoint committed" in proc.stdout and "(requested)" in proc.stdout


def test_allow_list_hides_third_party(hidden_run):
    assert hidden_run.returncode == 2 and "no optimizer plugin named 'lion'" in hidden_run.stderr


def tied_config(tmp_path):
    path = write_tiny_config(tmp_path, steps=6)
    text = path.read_text().replace(
        'name = "llama3"\nflavor = "debug"\ndim = 64\nn_layers = 2\n', 'name = "tiny_gpt"\nvocab_size = 512\ndim = 64\nn_layers = 2\nmax_seq_len = 128\n'
    )
    assert "tiny_gpt" in text
    path.write_text(text)
    return path


def test_tied_third_party_model_stays_tied(example_site, tmp_path):
    """The standard `lm_head.weight = wte.weight` tie survives plait's meta-device build, training
    and resume, and plan counts the parameters the run trains."""
    cfg = tied_config(tmp_path)
    out = tmp_path / "out"
    plan = run_module("core.plan", "--config", str(cfg), "--json", extra_env=example_site)
    assert plan.returncode == 0, plan.stderr
    planned = __import__("json").loads(plan.stdout)["params_total"]
    proc = run_module("core.train", "--config", str(cfg), "--checkpoint.every=3", extra_env=example_site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_module("core.train", "--config", str(cfg), "--train.steps=8", extra_env=example_site)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    for step in (3, 6, 8):
        model = flat_checkpoint(out / "checkpoints" / f"step_{step:09d}")["model"]
        assert (model["lm_head.weight"] == model["wte.weight"]).all(), f"untied at step {step}"
        trained = sum(t.numel() for k, t in model.items() if k != "lm_head.weight")
        assert trained == planned
    # Export and generate work with a spec without the optional max_seq_len (an AttributeError traceback before).
    ckpt = out / "checkpoints" / "step_000000008"
    proc = run_module("core.export", "--checkpoint", str(ckpt), "--format", "safetensors", "--out", str(tmp_path / "st"), extra_env=example_site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_module("core.generate", "--checkpoint", str(tmp_path / "st"), "--prompt", "RO", "--max-new-tokens", "4", extra_env=example_site)
    assert proc.returncode == 0 and proc.stdout.startswith("RO"), proc.stderr[-3000:]


def test_allow_list_errors_name_what_it_filters(example_site, hidden_run, tiny_config):
    cfg = str(tiny_config())
    assert hidden_run.returncode == 2 and "PLAIT_PLUGINS='' leaves out the installed plugin(s) example" in hidden_run.stderr
    proc = run_module("core.plan", "--config", cfg, extra_env={**example_site, "PLAIT_PLUGINS": "exmaple"})
    assert proc.returncode == 2
    assert "PLAIT_PLUGINS names 'exmaple', which no installed third-party plugin provides" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    # a built-in's entry-point name is not a third-party plugin: it was said to be not installed at all
    proc = run_module("core.plan", "--config", cfg, extra_env={**example_site, "PLAIT_PLUGINS": "example,llama3"})
    assert proc.returncode == 2 and "names 'llama3', which no installed third-party plugin provides (plait's own always load)" in proc.stderr


def test_third_party_versions_are_recorded(lion_run):
    import json

    proc, out = lion_run
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads((out / "run_info.json").read_text())
    assert info["versions"]["plugin:example"] == "plait-example-plugin 0.1.0"
    (checkpoint,) = (out / "checkpoints").glob("step_*")  # the one the monitor's stop saved
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["versions"]["plugin:example"] == "plait-example-plugin 0.1.0"


def full_third_party_config(tmp_path):
    """Model, data, optimizer, schedule, precision and monitor all from the example plugin
    (parallelism too with ``ddp_fp16``)."""
    path = tmp_path / "third.toml"
    path.write_text(f'''
extends = "{REPO / "train_configs" / "base.toml"}"
[train]
steps = 8
global_batch_tokens = 1024
micro_batch = 2
device = "cpu"
log_every = 1
output_dir = "{tmp_path / "out"}"
[model]
name = "tiny_gpt"
vocab_size = 64
dim = 64
max_seq_len = 128
[data]
name = "repeat"
period = 64
seq_len = 128
[optimizer]
name = "lion"
lr = 1e-3
[lr_schedule]
name = "step_decay"
every = 3
[precision]
name = "tf32"
[monitors]
enabled = ["jsonl", "loss_target"]
[monitors.loss_target]
target = 0.0
''')
    return path


@pytest.mark.parametrize(  # ddp (every other two-rank test's parallelism) and fp16: `pytest -m bench`
    "parallelism", [pytest.param("ddp", marks=pytest.mark.bench), "fsdp2", pytest.param("ddp_fp16", marks=pytest.mark.bench)]
)
def test_every_slot_from_a_third_party_trains_on_two_ranks_and_resumes_exactly(example_site, tmp_path, parallelism):
    from conftest import torchrun

    cfg = full_third_party_config(tmp_path)
    common = ("--config", str(cfg), f"--parallelism.name={parallelism}")
    straight = torchrun(2, *common, f"--train.output_dir={tmp_path / 'straight'}", extra_env=example_site)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = torchrun(2, *common, "--train.steps=4", extra_env=example_site)
    assert first.returncode == 0, first.stderr[-3000:]
    second = torchrun(2, *common, extra_env=example_site)
    assert second.returncode == 0 and "resumed from" in second.stdout, second.stderr[-3000:]
    want = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "straight")}
    got = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "out")}
    assert want[8] < want[1] - 0.5  # it learns
    for step in range(5, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-6), (step, got, want)
