"""The plugin contract as a third-party author meets it: an optional member set to None is absent
to every reader (the contract check, ``core.plan``, training, export), and a third-party data
source declares its tokenizer (``tokenizer()``), which the run records in its checkpoints for
``core.export`` and ``core.generate``. Real plugin distributions found through entry points, real
runs, real DCP checkpoints."""

from __future__ import annotations

import pytest

from core.contract.errors import PluginError
from core.contract.members import check_component, describe_contract

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


def test_the_rule_is_printed_with_the_contract_and_a_none_needed_member_still_counts():
    assert describe_contract().splitlines()[0] == "An optional member set to None is absent: the core then does without it (its default)."
    from test_contract import Spec

    class ExportsWithoutConfig(Spec):  # to_hf_state_dict needs hf_config: None is no config
        hf_config = None

        def to_hf_state_dict(self, sd):
            return sd

    with pytest.raises(PluginError, match="model plugin 'mine': to_hf_state_dict needs hf_config too"):
        check_component("model", "mine", ExportsWithoutConfig())

    class NoneRequired(Spec):
        activation_bytes = None  # type: ignore[assignment]  # a required member: None is no method

    with pytest.raises(PluginError, match="activation_bytes must be a method"):
        check_component("model", "mine", NoneRequired())


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


def test_a_reduced_value_that_is_no_number_is_left_out_and_a_bad_op_is_the_monitors_error(capsys):
    """One process: the values reduce to themselves; one that is no number is left out with a warning
    (never an exception in the core's reduction, which the other ranks would wait for)."""
    from core.api import Reduced
    from core.contract.protocols import DistInfo
    from core.runtime.monitor_reductions import reduce_monitor_values

    out = reduce_monitor_values({"loss": 1.5, "a": Reduced("mean", 2), "b": Reduced("max", [1.0, 3.0]), "c": Reduced("sum", "x")}, DistInfo())
    assert out["loss"] == 1.5 and out["a"] == 2.0 and out["b"].tolist() == [1.0, 3.0] and "c" not in out
    assert "monitor metric 'c': Reduced('sum', str) holds no number or tensor: left out" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Reduced: op 'median'; expected one of mean, sum, max, min"):
        Reduced("median", 1.0)
    # a finish turns the reduced sums into the metric; one that raises leaves it out, said once
    finished = reduce_monitor_values(
        {"r": Reduced("sum", [9.0, 4.0], finish=lambda t: float(t[0] / t[1])), "bad": Reduced("sum", 1, finish=lambda t: 1 / 0)}, DistInfo()
    )
    assert finished == {"r": 2.25}
    assert "monitor metric 'bad': its Reduced finish raised ZeroDivisionError: division by zero; left out" in capsys.readouterr().err


def test_a_reduced_value_no_reduction_can_take_is_left_out_never_an_exception(capsys):
    """An int beyond a float raised OverflowError, and a sparse or a meta tensor a RuntimeError in the
    reduction itself, out of the core on every rank (a traceback, exit 1, which launchers restart into
    the same crash); a tensor of millions of values was gathered from every rank and written whole into
    each metrics.jsonl line. A sparse tensor reduces as its dense one now, the others are left out with a
    warning; NaN and infinities reduce as numbers."""
    import torch

    from core.api import Reduced
    from core.contract.protocols import DistInfo
    from core.runtime.monitor_reductions import reduce_monitor_values

    MAX_ELEMENTS = 2**16  # core.runtime.monitor_reductions.MAX_ELEMENTS

    values = {
        "huge_int": Reduced("sum", 10**400),
        "sparse": Reduced("sum", torch.eye(3).to_sparse()),
        "meta": Reduced("max", torch.ones(2, device="meta")),
        "too_many": Reduced("mean", torch.zeros(MAX_ELEMENTS + 1)),
        "nan": Reduced("max", float("nan")),
        "inf": Reduced("min", float("-inf")),
        "ok": Reduced("sum", torch.ones(MAX_ELEMENTS)),
    }
    out = reduce_monitor_values(values, DistInfo())
    assert sorted(out) == ["inf", "nan", "ok", "sparse"] and out["nan"] != out["nan"] and out["inf"] == float("-inf"), out
    assert out["sparse"].tolist() == torch.eye(3).tolist()  # reduced as the dense tensor it stands for
    err = capsys.readouterr().err
    for name in ("huge_int", "meta", "too_many"):
        assert f"monitor metric {name!r}: Reduced(" in err and "left out" in err, err


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
