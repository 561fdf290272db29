"""What a third-party plugin author meets relying on the documented contract alone: every rank follows
any rank's verdict and a failure on rank 1 is named, a stream's per-rank position on another world size
is refused before training, a plugin that exits while it loads, a monitor's non-JSON ``run.state`` value
and a model whose forward returns a tuple (or that has no pipeline stage split under ``pp = 2``, no tensor-parallel plan under ``tp = 2``) are each one line naming the plugin. Real entry points (a
distribution on PYTHONPATH), real processes, two ranks under torchrun where ranks matter."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from conftest import run_module, torchrun, write_tiny_config
from shared import error_lines


def install(site: Path, code: str, package: str = "author_plugin") -> dict[str, str]:
    """A distribution ``author-plugin`` whose entry point ``author`` in group ``plait`` is ``package``."""
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(code)
    dist = site / f"{package}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[plait]\nauthor = {package}\n")
    return {"PYTHONPATH": str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")}


# A monitor whose verdict and failure depend on the rank: rank 1 alone skips step 2's update and
# raises in step 3's plait_step_end, after writing what its rank's weights sum to.
SPLIT = """
import json, os
from core.api import hookimpl

class Split:
    def __init__(self, options):
        pass

    @hookimpl
    def plait_before_update(self, run, step):
        return "skip" if run.dist.rank == 1 and step == 2 else None

    @hookimpl
    def plait_step_end(self, run, step):
        if step == 3:
            total = sum(float(p.detach().double().sum()) for p in run.model.parameters())
            with open(os.path.join(run.output_dir, f"weights_{run.dist.rank}.json"), "w") as f:
                json.dump(total, f)
            if run.dist.rank == 1:
                raise RuntimeError("rank 1's sensor broke")

@hookimpl
def plait_register(registry):
    registry.add("monitor", "split", Split, doc="decides and fails on rank 1 alone")
"""


def test_every_rank_follows_any_ranks_verdict_and_a_failure_on_rank_1_is_named(tmp_path):
    """A ``"skip"`` returned on rank 1 alone is followed by every rank, so the replicas' weights never
    part (nor does a rollback on one rank hang the others). And a monitor that fails on rank 1 only is
    named, not "requested by another rank": the ranks agree on the strongest verdict, the failing rank says so, and rank 0's stop line names the monitor."""
    env = install(tmp_path / "site", SPLIT)
    cfg = write_tiny_config(tmp_path, steps=6)
    proc = torchrun(2, "--config", str(cfg), '--monitors.enabled=["console", "split"]', extra_env=env)
    out = tmp_path / "out"
    sums = [json.loads((out / f"weights_{r}.json").read_text()) for r in (0, 1)]
    assert sums[0] == sums[1], (sums, proc.stderr[-3000:])  # the replicas stayed the same
    status = json.loads((out / "exit_status.json").read_text())
    assert status["exit_code"] == 4 and status["step"] == 3, (status, proc.stderr[-3000:])
    assert status["detail"] == "requested by rank 1: monitor 'split' failed in plait_step_end: RuntimeError: rank 1's sensor broke"
    assert "plait: error: rank 1: monitor 'split' failed in plait_step_end: RuntimeError: rank 1's sensor broke" in proc.stderr
    assert "step 2: update skipped" in proc.stdout  # on every rank, rank 0 included
    assert (out / "checkpoints" / "step_000000003" / "COMMITTED").is_file()


# A stream whose loader keeps a position per rank (``per_rank_state``) and declares no check_resume.
STREAM = """
import torch
from core.api import hookimpl, log

class Loader:
    per_rank_state = True
    may_end = True

    def __init__(self, spec):
        self.spec, self.n = spec, 0

    def __iter__(self):
        while True:
            s = self.spec
            ids = (torch.arange(s.micro_batch * (s.seq_len + 1)).view(s.micro_batch, -1) + self.n + s.dp_rank) % 50
            self.n += 1
            yield ids[:, :-1], ids[:, 1:]

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]

class Counting:
    def __init__(self, options):
        pass

    def validate(self, vocab_size, seq_len):
        pass

    def loader(self, spec):
        log.info(f"counting: loader for rank {spec.dp_rank}", all_ranks=True)
        return Loader(spec)

@hookimpl
def plait_register(registry):
    registry.add("data", "counting", Counting, doc="a per-rank stream of counting ids")
"""


def test_a_streams_per_rank_position_on_another_world_size_is_refused_before_training(tmp_path):
    """``per_rank_state`` positions resume only at the world size that saved them. The core found
    out only at the load, after the model and the loader were built, and ``core.plan`` for that
    world size said nothing. Now both refuse it before anything is built, in the same line."""
    env = install(tmp_path / "site", STREAM)
    cfg = write_tiny_config(tmp_path, steps=2)
    data = ["--data.name=counting", "--model.vocab_size=64"]
    first = run_module("core.train", "--config", str(cfg), *data, extra_env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    expected = "the streaming data position was saved on 1 ranks and cannot resume on 2"
    plan = run_module("core.plan", "--config", str(cfg), *data, "--train.steps=4", "--nproc=2", extra_env=env)
    assert plan.returncode == 2 and len(error_lines(plan)) == 1 and expected in error_lines(plan)[0], plan.stdout[-2000:] + plan.stderr[-2000:]
    again = torchrun(2, "--config", str(cfg), *data, "--train.steps=4", extra_env=env)
    assert again.returncode != 0 and f"plait: error: checkpoint {tmp_path / 'out' / 'checkpoints' / 'step_000000002'}: {expected}" in again.stderr
    assert "counting: loader" not in again.stdout  # refused before anything was built


@pytest.mark.parametrize(
    "code, expected",
    [
        ("import sys\nsys.exit(0)\n", "failed to import: SystemExit: 0"),
        ("import argparse\nargparse.ArgumentParser().parse_args(['--no-such-flag'])\n", "failed to import: SystemExit: 2"),
        ("from core.api import hookimpl\n@hookimpl\ndef plait_register(registry):\n    raise SystemExit(3)\n", "failed in plait_register: SystemExit: 3"),
        (
            "from core.api import hookimpl\nfrom core.data.text_tokenizers import Tokenizer\n",
            "failed to import: ModuleNotFoundError: No module named 'core.data.text_tokenizers'; plugins import from core.api alone: "
            "from core.api import Tokenizer;",
        ),
    ],
)
def test_a_plugin_that_exits_while_it_loads_is_one_line_naming_it(tmp_path, code, expected):
    """``sys.exit`` (or argparse at module level) in a plugin's import ended ``core.train`` and
    ``core.plan`` with that plugin's exit code and not a word: exit 0 looked like a finished run. An
    import of an internal ``core`` path is one line too, naming the ``core.api`` import to write."""
    env = install(tmp_path / "site", code)
    proc = run_module("core.plan", "--config", str(write_tiny_config(tmp_path)), extra_env=env)
    lines = error_lines(proc)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "plugin 'author' (distribution author-plugin" in lines[0] and expected in lines[0], lines
    if "failed to import" in expected:  # the way out is in the line (docs/writing_plugins.md: leave it out of PLAIT_PLUGINS)
        others = re.search(r"; to run without it: PLAIT_PLUGINS=(\S+) \(the other third-party plugins\), or uninstall author-plugin$", lines[0])
        assert others, lines
        again = run_module("core.plan", "--config", str(write_tiny_config(tmp_path)), extra_env={**env, "PLAIT_PLUGINS": others[1].strip("'")})
        assert again.returncode == 0, again.stderr[-2000:]


KEEPS_A_SET = """
import json, os
from core.api import hookimpl

class KeepsASet:
    def __init__(self, options):
        pass

    @hookimpl
    def plait_step_end(self, run, step):
        run.state["seen"] = {"steps": {step}}

    @hookimpl
    def plait_train_end(self, run, reason):
        with open(os.path.join(run.output_dir, "train_end.json"), "w") as f:
            json.dump(reason, f)

@hookimpl
def plait_register(registry):
    registry.add("monitor", "keeps_a_set", KeepsASet, doc="keeps a set in run.state")
"""


def test_a_monitors_run_state_value_that_is_not_json_stops_the_run_naming_the_key(tmp_path):
    """A set in ``run.state`` is neither a TypeError in the middle of the first save nor left out of
    every checkpoint without a word: the run stops before the save writes anything: one line naming
    the key, exit 2 (``bad_input`` in exit_status.json), and the monitors hear ``plait_train_end``."""
    env = install(tmp_path / "site", KEEPS_A_SET)
    cfg = write_tiny_config(tmp_path, steps=4, body="[checkpoint]\nevery = 2\n")
    proc = run_module("core.train", "--config", str(cfg), '--monitors.enabled=["console", "keeps_a_set"]', extra_env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error_lines(proc) == [
        "plait: error: run.state['seen'] is not a JSON value (Object of type set is not JSON serializable); "
        "a monitor keeps only JSON values there (numbers, strings, lists, dicts): every checkpoint saves them"
    ]
    out = tmp_path / "out"
    status = json.loads((out / "exit_status.json").read_text())
    assert (status["exit_code"], status["reason"], status["step"]) == (2, "bad_input", 2)
    assert json.loads((out / "train_end.json").read_text()) == "error"
    assert not (out / "checkpoints" / "step_000000002").exists()


HF_HABIT = """
import torch.nn.functional as F
from torch import nn
from core.api import hookimpl

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.blocks, self.head = nn.Embedding(512, 16), nn.ModuleList([nn.Linear(16, 16)]), nn.Linear(16, 512)

    def forward(self, ids, labels=None):
        logits = self.head(self.blocks[0](self.emb(ids)))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits  # the Hugging Face habit

class Spec:
    vocab_size = 512

    def __init__(self, options):
        pass

    def build(self):
        return Net()

    def init_weights(self, model):
        for p in model.parameters():
            nn.init.normal_(p, std=0.02)

    def blocks(self, model):
        return list(model.blocks)

    def flops_per_token(self, seq_len):
        return 6.0 * 16 * 1024

    def activation_bytes(self, micro_batch, seq_len, bytes_per_element):
        return micro_batch * seq_len * 1024 * bytes_per_element

@hookimpl
def plait_register(registry):
    registry.add("model", "hf_habit", Spec, doc="forward returns (loss, logits)")
"""


def test_a_model_whose_forward_returns_a_tuple_is_one_line_naming_it(tmp_path):
    """``forward(ids, labels)`` returning ``(loss, logits)`` is one line naming the model plugin, exit 2,
    nothing trained: not a TypeError at the first step that launchers would restart into."""
    env = install(tmp_path / "site", HF_HABIT)
    cfg = write_tiny_config(tmp_path, steps=2).read_text().replace('name = "llama3"\nflavor = "debug"\ndim = 64\nn_layers = 2\n', 'name = "hf_habit"\n')
    (tmp_path / "run.toml").write_text(cfg)
    proc = run_module("core.train", "--config", str(tmp_path / "run.toml"), extra_env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error_lines(proc) == ["plait: error: model 'hf_habit': forward(ids, labels) returned tuple; expected the mean loss, a 0-dim tensor"]
    status = json.loads((tmp_path / "out" / "exit_status.json").read_text())
    assert (status["exit_code"], status["reason"], status["step"]) == (2, "bad_input", 0)
    # a model spec without a pipeline stage split runs without pipelining only: pp = 2 is one line, before any process group
    plan = run_module("core.plan", "--config", str(tmp_path / "run.toml"), "--nproc", "2", "--parallelism.name=fsdp2", "--parallelism.pp=2", extra_env=env)
    assert plan.returncode == 2 and "Traceback" not in plan.stderr, plan.stderr[-3000:]
    assert "[parallelism] pp = 2: model 'hf_habit' has no pipeline stage split (pipeline_stages); expected pp = 1" in error_lines(plan)[0]
    # a model spec without the tensor-parallel members runs data-parallel only: tp = 2 is one line, before any process group
    plan = run_module("core.plan", "--config", str(tmp_path / "run.toml"), "--nproc", "2", "--parallelism.name=fsdp2", "--parallelism.tp=2", extra_env=env)
    assert plan.returncode == 2 and "Traceback" not in plan.stderr, plan.stderr[-3000:]
    assert "[parallelism] tp = 2: model 'hf_habit' has no tensor-parallel plan (parallelize_tensor); expected tp = 1" in error_lines(plan)[0]
