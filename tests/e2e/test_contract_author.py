"""The plugin contract as a third-party author meets it: an optional member set to None is absent
to every reader (the contract check, ``core.plan``, training, export), a third-party data source's
declared tokenizer reaches ``core.export`` and ``core.generate`` (a wrong one is one line before anything
is built), and a monitor's reduction over ranks is the core's (values that differ between ranks are left
out on both; a failure on one rank ends every rank promptly). Real plugin distributions found through
entry points, real runs, real DCP checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import REPO, run_module, torchrun, write_tiny_config
from shared import bpe, error_lines
from test_plugin_author import install

from core.contract.errors import DataError, PluginError

# Every optional member of every slot the plugins fill, set to None: what a plugin author writes
# for "I have none" (``hf_config = None``, ``tokens_per_epoch = None``).
NONES = """
from core.api import hookimpl
from model_specs.llama3.spec import Llama3Options, Llama3Spec
from plugins.data.synthetic import Synthetic, SyntheticOptions
from plugins.optim.adamw import AdamW, AdamWOptions
from plugins.parallelism.single import Single, SingleOptions
from plugins.precision.basic import FP32, FP32Options

class Model:
    high_precision_modules = compile_loss = param_counts = max_seq_len = None
    to_hf_state_dict = from_hf_state_dict = hf_config = None
    architecture_options = resolved_architecture = None

    def __init__(self, options):
        self.llama = Llama3Spec.from_options(options)
        self.vocab_size = self.llama.vocab_size

    def build(self):
        return self.llama.build()

    def init_weights(self, model):
        self.llama.init_weights(model)

    def blocks(self, model):
        return self.llama.blocks(model)

    def flops_per_token(self, seq_len):
        return self.llama.flops_per_token(seq_len)

    def activation_bytes(self, micro_batch, seq_len, bytes_per_element):
        return self.llama.activation_bytes(micro_batch, seq_len, bytes_per_element)

class Data(Synthetic):
    has_split = check_resume = metrics = tokens_per_epoch = fingerprint = tokenizer = None
    validation_loaders = check_first_step = parts = samples_before_loader = None

class Optimizer(AdamW):
    state_bytes_per_param = separate_output_head = None

class Parallelism(Single):
    check_world = shards_parameters = wraps_before_compile = None

class Precision(FP32):
    check_model = post_optimizer_step = log_step = None

@hookimpl
def plait_register(registry):
    registry.add("model", "nones", Model, options=Llama3Options, doc="llama3 with every optional member None")
    registry.add("data", "nones", Data, options=SyntheticOptions, doc="synthetic with every optional member None")
    registry.add("optimizer", "nones", Optimizer, options=AdamWOptions, doc="adamw without a state size")
    registry.add("parallelism", "nones", Parallelism, options=SingleOptions, doc="single without its optional members")
    registry.add("precision", "nones", Precision, options=FP32Options, doc="fp32 without its optional members")
"""

NONE_RUN = ["--model.name=nones", "--data.name=nones", "--optimizer.name=nones", "--parallelism.name=nones", "--precision.name=nones"]


@pytest.mark.slow  # spawns plait's commands
def test_an_optional_member_set_to_none_is_absent_to_every_reader(tmp_path):
    """``hf_config = None`` or ``tokens_per_epoch = None`` was refused by the contract check ("must be a
    method") while the core's readers took None for "absent"; ``state_bytes_per_param = None`` was a
    TypeError in ``core.plan``, a spec's ``hf_config = None`` one in the hf export. Now None is absent
    everywhere: the run plans, trains and exports, and the hf export says the spec lacks it."""
    env = install(tmp_path / "site", NONES)
    cfg = write_tiny_config(tmp_path, steps=2)
    plan = run_module("core.plan", "--config", str(cfg), *NONE_RUN, extra_env=env)
    assert plan.returncode == 0, plan.stderr[-3000:]
    train = run_module("core.train", "--config", str(cfg), *NONE_RUN, extra_env=env)
    assert train.returncode == 0, train.stderr[-3000:]
    ckpt = tmp_path / "out" / "checkpoints" / "step_000000002"
    assert (ckpt / "COMMITTED").is_file()
    hf = run_module("core.export", "--checkpoint", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf"), extra_env=env)
    assert hf.returncode == 2 and "Traceback" not in hf.stderr, hf.stderr[-3000:]
    assert error_lines(hf) == [
        "plait: error: model 'nones' does not support hf export: its spec lacks to_hf_state_dict and hf_config (core/contract/members.py); use --format safetensors"
    ]
    st = run_module("core.export", "--checkpoint", str(ckpt), "--format", "safetensors", "--out", str(tmp_path / "st"), extra_env=env)
    assert st.returncode == 0 and (tmp_path / "st" / "model.safetensors").is_file(), st.stderr[-3000:]
    listing = run_module("core.plugins", "--slot", "model", extra_env=env)
    block = re.split(r"\n  (?=\S)", listing.stdout.split("  nones  -- ")[1])[0]  # its lines, up to the next component
    assert listing.returncode == 0 and "\n      optional: none" in block, listing.stdout[-2000:]  # what it provides: None is none


# A third-party source of token ids made with a Hugging Face tokenizer it names itself: nothing in
# its [data] section is a tokenizer key or a folder with meta.json.
OWN_TOKENIZER = """
import numpy as np
from core.api import IndexedSource, TokenizerSpec, hookimpl, option
from dataclasses import dataclass

@dataclass
class Options:
    tokenizer_file: str = option("tok/tokenizer.json", "its tokenizer, from the working directory")
    text: str = option("to be or not to be, that is the question. ", "what it repeats")
    declares: str = option("", "the file tokenizer() names (empty: tokenizer_file)")

class OwnTokenizer(IndexedSource):
    def __init__(self, options):
        self.options = options
        self.ids = None

    def validate(self, vocab_size, seq_len):
        from tokenizers import Tokenizer

        self.ids = np.array(Tokenizer.from_file(self.options.tokenizer_file).encode(self.options.text * 64).ids, dtype=np.int64)

    def sample(self, index, seq_len, split):
        start = (index * 7) % (len(self.ids) - seq_len - 1)
        return self.ids[start : start + seq_len + 1]

    def tokenizer(self):
        return TokenizerSpec("hf:" + (self.options.declares or self.options.tokenizer_file), eos_id=0)

@hookimpl
def plait_register(registry):
    registry.add("data", "own_tokenizer", OwnTokenizer, options=Options, doc="ids of a tokenizer it names itself")
"""


def own_tokenizer_config(tmp_path: Path, **train) -> None:
    """``tmp_path/run.toml``: the tiny run on the ``own_tokenizer`` source."""
    cfg = write_tiny_config(tmp_path, **train).read_text().replace('name = "token_bin"\n', 'name = "own_tokenizer"\n')
    (tmp_path / "run.toml").write_text(cfg.replace(f'path = "{REPO / "plugins" / "data" / "corpus" / "shakespeare"}"\n', ""))


@pytest.mark.slow  # spawns plait's commands
def test_a_third_party_sources_declared_tokenizer_reaches_export_and_generate(tmp_path):
    """Only the built-in sources' sections were understood: a third-party source had no way to name
    its tokenizer, so ``core.export`` wrote no tokenizer files and ``core.generate`` said "no tokenizer
    recorded". Its ``tokenizer()`` is now recorded in every checkpoint (absolute path, sha256, EOS)."""
    pytest.importorskip("tokenizers", reason="the Hugging Face tokenizers library is a dependency of the 'dev' extra")
    env = install(tmp_path / "site", OWN_TOKENIZER)
    tok = bpe(tmp_path / "tok")
    own_tokenizer_config(tmp_path, steps=3)
    train = run_module("core.train", "--config", "run.toml", cwd=tmp_path, extra_env=env)  # tok/tokenizer.json from the working directory
    assert train.returncode == 0, train.stderr[-3000:]
    ckpt = tmp_path / "out" / "checkpoints" / "step_000000003"
    recorded = json.loads((ckpt / "state.json").read_text())["tokenizer"]
    assert recorded["spec"] == f"hf:{tok}" and recorded["eos_id"] == 0 and len(recorded["fingerprint"]) == 64
    out = tmp_path / "hf"
    export = run_module("core.export", "--checkpoint", str(ckpt), "--format", "hf", "--out", str(out), extra_env=env)
    assert export.returncode == 0 and "no tokenizer exported" not in export.stderr, export.stderr[-3000:]
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert json.loads((out / "plait.json").read_text())["tokenizer"] == "hf:tokenizer.json"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    prompt = "to be or not"
    for source in (ckpt, out):  # the checkpoint, and the export folder alone
        gen = run_module("core.generate", "--checkpoint", str(source), "--prompt", prompt, "--max-new-tokens", "8", extra_env=env)
        assert gen.returncode == 0, gen.stderr[-3000:]
        assert gen.stdout.startswith(prompt) and len(gen.stdout) > len(prompt) + 1, gen.stdout


@pytest.mark.slow  # spawns plait's commands
def test_a_declared_tokenizer_that_is_wrong_is_one_line_before_anything_is_built(tmp_path, monkeypatch):
    from core.data.tokenizer_spec import TokenizerSpec, declared_tokenizer

    def source(answer):
        return type("Source", (), {"tokenizer": lambda self: answer})()

    monkeypatch.chdir(tmp_path)
    with pytest.raises(PluginError, match=r"data 'mine': tokenizer\(\) returned str; expected a core.api.TokenizerSpec or None"):
        declared_tokenizer(source("hf:tok.json"), "data 'mine'")
    with pytest.raises(PluginError, match=r"tokenizer\(\) returned spec 'gpt2'; expected bytes, hf:PATH or tiktoken:PATH"):
        declared_tokenizer(source(TokenizerSpec("gpt2")), "data 'mine'")
    with pytest.raises(PluginError, match=r"returned eos_id -1; expected a token id"):
        declared_tokenizer(source(TokenizerSpec("bytes", -1)), "data 'mine'")
    with pytest.raises(DataError, match=rf"data 'mine': tokenizer\(\) names 'hf:tok.json', and {tmp_path / 'tok.json'} is not a file"):
        declared_tokenizer(source(TokenizerSpec("hf:tok.json")), "data 'mine'")
    assert declared_tokenizer(source(None), "data 'mine'") is None
    assert declared_tokenizer(source(TokenizerSpec("bytes", 256)), "data 'mine'") == {"spec": "bytes", "eos_id": 256, "fingerprint": None}
    # a whole run: core.plan refuses the same in one line, exit 2
    env = install(tmp_path / "site", OWN_TOKENIZER)
    own_tokenizer_config(tmp_path)
    bpe(tmp_path / "tok")
    plan = run_module("core.plan", "--config", "run.toml", "--data.declares=tok/none.json", cwd=tmp_path, extra_env=env)
    assert plan.returncode == 2 and len(error_lines(plan)) == 1, plan.stderr[-3000:]
    assert "tokenizer() names 'hf:tok/none.json'" in error_lines(plan)[0]


# A monitor that reduces over the ranks the declared way, and fails on rank 1 alone at step 3.
REDUCES = """
import torch
from core.api import Reduced, hookimpl

class Reduces:
    def __init__(self, options):
        pass

    @hookimpl
    def plait_metrics(self, run, step):
        if run.dist.rank == 1 and step == 3:
            raise RuntimeError("rank 1's counter broke")
        return {"ranks_sum": Reduced("sum", run.dist.rank + 1), "ranks_max": Reduced("max", torch.tensor(float(run.dist.rank)))}

@hookimpl
def plait_register(registry):
    registry.add("monitor", "reduces", Reduces, doc="sums and maxes over the ranks through Reduced")
"""


@pytest.mark.slow  # spawns plait's commands
def test_a_monitors_reduction_over_ranks_is_the_cores_and_a_failure_on_one_rank_ends_every_rank_promptly(tmp_path):
    """A monitor reducing over the ranks issued its own collective in ``plait_metrics``; failing on
    rank 1 before it, it left rank 0 waiting in it until the collective timeout. It returns
    ``Reduced`` values now: the core reduces them in collectives every rank joins whatever failed,
    and the failure stops both ranks at that step (exit 4), the values left out."""
    env = install(tmp_path / "site", REDUCES)
    cfg = write_tiny_config(tmp_path, steps=6)
    proc = torchrun(2, "--config", str(cfg), '--monitors.enabled=["console", "jsonl", "reduces"]', timeout=240, extra_env=env)
    out = tmp_path / "out"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in rows if "ranks_sum" in r or "loss" in r}
    assert [train[s]["ranks_sum"] for s in (1, 2)] == [3.0, 3.0] and [train[s]["ranks_max"] for s in (1, 2)] == [1.0, 1.0], rows
    assert "ranks_sum" not in train[3]  # rank 1's failed: left out on every rank
    status = json.loads((out / "exit_status.json").read_text())
    assert status["exit_code"] == 4 and status["step"] == 3, (status, proc.stderr[-3000:])
    assert "monitor 'reduces' failed in plait_metrics: RuntimeError: rank 1's counter broke" in status["detail"]
    assert "monitor metrics to reduce differ between ranks" in proc.stderr


REDUCE_ON_TWO_RANKS = """
import json, torch, torch.distributed as dist
from core.api import Reduced
from core.contract.protocols import DistInfo
from core.runtime.monitor_reductions import reduce_monitor_values
dist.init_process_group("gloo")
rank = dist.get_rank()
cases = [
    {"a": Reduced("sum", 1.0)} if rank == 0 else {},  # a Reduced on one rank only
    {"a": Reduced("sum", torch.ones(2 + rank))},  # other shapes on each rank
    {"a": Reduced("max", float("nan") if rank else 1.0), "b": Reduced("sum", float("inf"))},
    {"a": Reduced("sum", 10**400 if rank else 1.0)},  # no number on one rank
    {"a": Reduced("sum", torch.zeros(2**17) if rank else torch.zeros(2))},
]
for metrics in cases:
    out = reduce_monitor_values({"loss": 1.0, **metrics}, DistInfo(rank=rank, world_size=2))
    print(json.dumps({k: float(v) for k, v in out.items()}), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow  # spawns a torchrun job
def test_reduced_values_that_differ_between_two_ranks_are_left_out_on_both(tmp_path):
    """Two real ranks (gloo): a Reduced on one rank only, other shapes, NaN on one rank, no number on
    one rank, too many values on one: every case ends on both ranks with the same metrics, none hangs."""
    import subprocess

    from conftest import env as plait_env
    from conftest import torchrun_argv

    script = tmp_path / "reduce.py"
    script.write_text(REDUCE_ON_TWO_RANKS)
    argv = torchrun_argv(2, script=script)
    proc = subprocess.run([*argv[:4], "--tee=3", *argv[4:]], cwd=REPO, env=plait_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {}
    for line in proc.stdout.splitlines():  # torchrun --tee prefixes each rank's lines with [default<rank>]
        if ":{" in line:
            rank, _, row = line.partition(":")
            lines.setdefault(rank.strip("[]").removeprefix("default"), []).append(json.loads(row))
    assert lines["0"] == lines["1"] and len(lines["0"]) == 5, proc.stdout
    rows = lines["0"]
    assert rows[0] == rows[1] == rows[3] == rows[4] == {"loss": 1.0}
    assert rows[2]["a"] != rows[2]["a"] and rows[2]["b"] == float("inf"), rows[2]
