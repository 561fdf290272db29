"""What the core asks a third-party plugin before a run (validate, the first sample, has_split, the
model's build and cheap answers, the options' check) is asked through the contract only, and a plugin
that raises or answers in the wrong shape is one line naming the plugin and the member, never a
traceback from ``core.plan``/``core.train`` nor a silent pass. The core reads no undeclared
name off a data source (``streams``, ``labels``, ``sources``) and sets none on it (``model_vocab_size``).
Real components, registered in the real registry for the test; ``prepare`` as the commands run it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest

from core.api import SLOT_PROTOCOLS, PreparedRun, hookimpl
from core.config import registry as registry_mod
from core.contract.errors import ConfigError, DataError, PlaitError, PluginError
from core.contract.option_values import build_options
from core.contract.options import option
from core.contract.protocols import LoaderSpec
from core.data.indexed import IndexedSource
from core.preflight.prepare import prepare


@dataclass
class FaultOptions:
    fault: str = option("none", "which misbehaviour to show")


class Data(IndexedSource):
    """A data source that misbehaves in the member its ``fault`` option names."""

    def __init__(self, options):
        self.fault = options.fault
        if self.fault == "streams_attribute":  # the author's own attribute; the core once read it as "a stream inside"
            self.streams = ["my", "shards"]

    def validate(self, vocab_size, seq_len):
        if self.fault == "validate":
            raise RuntimeError("boom in validate")

    def has_split(self, split):
        if self.fault == "has_split":
            raise RuntimeError("boom in has_split")
        return "no" if self.fault == "has_split_str" else split == "train"

    def sample(self, index, seq_len, split):
        if self.fault == "sample":
            raise KeyError("boom in sample")
        ids = np.arange(seq_len + 1, dtype=np.int64) % 50
        if self.fault == "torch_sample":
            import torch

            return torch.from_numpy(ids)
        return ids + 10_000 if self.fault == "streams_attribute" else ids

    def tokens_per_epoch(self):
        return "lots" if self.fault == "tokens_per_epoch" else None

    def fingerprint(self):
        if self.fault == "fingerprint":
            raise RuntimeError("boom in fingerprint")
        return None


class Parts(Data):
    """A composite source of its own (not the built-in mixture) that declares its parts."""

    def parts(self):
        return {"left": Data(FaultOptions()), "right": Repeatless()}


class Repeatless:  # a part without has_split: assumed to have every split
    pass


class Model:
    """A small model spec that misbehaves in the member its ``fault`` option names."""

    def __init__(self, options):
        self.fault, self.vocab_size = options.fault, 512

    def build(self):
        import torch

        if self.fault == "build":
            raise RuntimeError("boom in build")
        if self.fault == "build_not_a_module":
            return {"not": "a module"}
        return torch.nn.Sequential(torch.nn.Embedding(512, 16), torch.nn.Linear(16, 512))

    def init_weights(self, model): ...
    def blocks(self, model):
        return [model[1]]

    def flops_per_token(self, seq_len):
        return None if self.fault == "flops_per_token" else 1e6

    def activation_bytes(self, micro_batch, seq_len, bytes_per_element):
        return "lots" if self.fault == "activation_bytes" else 1000


@pytest.fixture
def third_party():
    """Register this file's components in the process's registry as plugin 'atk' (removed after)."""
    reg = registry_mod.load()
    added = [("data", "atk_data", Data), ("data", "atk_parts", Parts), ("model", "atk_model", Model)]
    reg._plugin, reg._distribution = "atk", "atk-plugin"
    for slot, name, factory in added:
        reg.add(slot, name, factory, options=FaultOptions, doc="misbehaves on request")
    yield
    for slot, name, _ in added:
        del reg._components[slot][name]


def plan(config, *overrides: str):
    return prepare(str(config), list(overrides), validate_data=True, dry_run=True)


def one_line(err: pytest.ExceptionInfo, words: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and words in msg, msg


@pytest.mark.parametrize(
    "fault, extra, words",
    [
        ("validate", [], "data 'atk_data': validate failed: RuntimeError: boom in validate"),
        ("sample", [], "data 'atk_data': sample failed: KeyError: 'boom in sample'"),
        (
            "torch_sample",
            [],
            "data 'atk_data': sample(0, seq_len=128, 'train') returned a torch.Tensor (torch.int64); expected a numpy integer array of "
            "seq_len + 1 = 129 token ids (tensor.numpy() gives one)",
        ),
        ("tokens_per_epoch", [], "data 'atk_data': tokens_per_epoch() returned 'lots'; expected an int >= 0 or None"),
        ("fingerprint", [], "data 'atk_data': fingerprint failed: RuntimeError: boom in fingerprint"),
        ("has_split", ["--validation.every=2"], "data 'atk_data': has_split failed: RuntimeError: boom in has_split"),
        ("has_split_str", ["--validation.every=2"], "data 'atk_data': has_split('val') returned 'no'; expected True or False"),
    ],
)
def test_a_data_plugin_that_raises_or_answers_wrong_is_one_line_naming_it(third_party, tiny_config, fault, extra, words):
    with pytest.raises(PluginError) as e:
        plan(tiny_config(), "--data.name=atk_data", f"--data.fault={fault}", *extra)
    one_line(e, words)


@pytest.mark.parametrize(
    "fault, words",
    [
        ("build", "model 'atk_model': build failed: RuntimeError: boom in build"),
        ("build_not_a_module", "model 'atk_model': build() returned dict; expected a torch.nn.Module"),
        ("flops_per_token", "model 'atk_model': flops_per_token(128) returned None; expected a finite number > 0"),
        ("activation_bytes", "model 'atk_model': activation_bytes(2, 128, 4) returned 'lots'; expected a finite number >= 0"),
    ],
)
def test_a_model_plugin_that_raises_or_answers_wrong_is_one_line_naming_it(third_party, tiny_config, tmp_path, fault, words):
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'extends = "{tiny_config()}"\n[model]\nname = "atk_model"\n')
    with pytest.raises(PluginError) as e:
        plan(cfg, f"--model.fault={fault}")
    one_line(e, words)


def test_a_sample_as_a_torch_tensor_stops_core_train_with_exit_2_before_training(third_party, tiny_config, tmp_path):
    """``sample()`` returning a torch tensor (not the numpy array the contract asks for) is one line
    naming the plugin, exit code 2, and no run folder: refused before anything trains."""
    from conftest import run_here

    proc = run_here("core.train", "--config", str(tiny_config()), "--data.name=atk_data", "--data.fault=torch_sample")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("plait: error: ")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "data 'atk_data': sample(0, seq_len=128, 'train') returned a torch.Tensor (torch.int64); expected a numpy integer array" in lines[0]
    assert not (tmp_path / "out").exists()


def test_an_attribute_named_streams_does_not_switch_off_the_first_sample_check(third_party, tiny_config):
    """The core skipped the first-sample check of any source with a truthy ``streams`` attribute (the
    mixture's private name); ids beyond the vocabulary then passed the start. Now only the declared
    ``samples_before_loader = False`` does."""
    with pytest.raises(DataError) as e:
        plan(tiny_config(), "--data.name=atk_data", "--data.fault=streams_attribute")
    one_line(e, "returned token ids from 10000 to 10049; expected ids in 0..511")


def test_a_third_party_composite_source_names_its_parts_through_the_declared_parts(third_party, tiny_config):
    """A composite source declares its parts through ``parts()``: the parts lacking the validation split are
    named from them, with the same message as the built-in mixture's."""
    with pytest.raises(ConfigError) as e:
        plan(tiny_config(), "--data.name=atk_parts", "--validation.every=2")
    one_line(e, "has no 'val' split (source 'left' of the mixture: no 'val' split)")


def test_the_core_sets_nothing_on_the_data_source(third_party, tiny_config):
    """The vocabulary bound reaches the loader through LoaderSpec.vocab_size, not an attribute the core
    set on the plugin's object; a mixture's per-source validation loaders are bounded by it too."""
    prep = plan(tiny_config(), "--data.name=atk_data")
    assert "model_vocab_size" not in vars(prep.components["data"])
    from plugins.data.mixture import Mixture, MixtureOptions

    mix = Mixture(MixtureOptions(sources=[{"name": "atk_data", "weight": 1.0, "label": "a"}]))
    loaders = mix.validation_loaders(LoaderSpec(seq_len=16, micro_batch=2, grad_accum=1, dp_rank=0, dp_size=1, seed=0, split="train", vocab_size=10))
    with pytest.raises(DataError, match=r"returned token ids from 0 to 16; expected ids in 0..9"):
        next(iter(loaders["a"]))


@dataclass
class Checked:
    x: int = option(1, "x")

    def check(self):
        if self.x == 2:
            raise TypeError("x cannot be 2")


@dataclass
class Required:
    path: str = dataclasses.field(metadata={"doc": "where the data is"})


def test_an_options_check_that_raises_anything_else_is_one_line_naming_the_section():
    with pytest.raises(PlaitError) as e:
        build_options(Checked, {"x": 2}, "run.toml: [lr_schedule] (lr_schedule 'atk')")
    one_line(e, "[lr_schedule] (lr_schedule 'atk'): check() failed: TypeError: x cannot be 2 (check() should raise ValueError)")


@dataclass(kw_only=True)
class RequiredByOption:
    weights: list[float] = option([1.0, 2.0], "a list default: each options object gets its own copy", gt=0)
    path: str = option(dataclasses.MISSING, "where the data is")


@pytest.mark.parametrize("options", [Required, RequiredByOption])
def test_an_option_without_a_default_is_named_when_unset(options):
    """A required option, declared as ``option(dataclasses.MISSING, doc)`` (``core.api.option``) or as a
    bare field with a doc, is registered, and a config that leaves it unset is one line naming it."""
    registry_mod.Registry().add("data", "atk", object, options=options, doc="a required option")
    with pytest.raises(ConfigError) as e:
        build_options(options, {}, "run.toml: [data] (data 'atk')")
    one_line(e, "[data] (data 'atk'): missing key 'path' (where the data is): this option has no default; set it")
    assert build_options(options, {"path": "x"}, "w").path == "x"
    if options is RequiredByOption:
        first, second = (build_options(options, {"path": "x"}, "w") for _ in range(2))
        first.weights.append(3.0)
        assert second.weights == [1.0, 2.0]


class Optimizer:
    """An optimizer plugin whose build() returns what its ``fault`` option names."""

    def __init__(self, options):
        from plugins.optim.adamw import AdamWOptions

        self.fault, self.options = options.fault, AdamWOptions()

    def build(self, groups):
        import torch

        return {"lr": 1.0} if self.fault == "build_not_an_optimizer" else torch.optim.SGD(groups, lr=0.1)


class Loader(IndexedSource):
    """A data source whose loader() returns a plain list of batches when its ``fault`` asks."""

    def __init__(self, options):
        self.fault = options.fault

    def validate(self, vocab_size, seq_len): ...
    def sample(self, index, seq_len, split):
        return np.arange(seq_len + 1, dtype=np.int64) % 50

    def loader(self, spec):
        return [] if self.fault == "loader_a_list" else super().loader(spec)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            ["--optimizer.name=atk_opt", "--optimizer.fault=build_not_an_optimizer"],
            "optimizer 'atk_opt': build() returned dict; expected a torch.optim.Optimizer",
        ),
        (["--data.name=atk_loader", "--data.fault=loader_a_list"], "data 'atk_loader': loader() returned list; expected an iterable with state_dict()"),
    ],
)
def test_what_a_plugin_builds_for_the_run_is_held_to_the_contract(tiny_config, overrides, words):
    """optimizer.build() and data.loader() run once the process group exists: a wrong answer is one line
    naming the plugin, not an AttributeError from deep in the loop or the checkpointer."""
    from core.loop.assemble import assemble
    from core.runtime import distributed

    reg = registry_mod.load()
    added = [("optimizer", "atk_opt", Optimizer), ("data", "atk_loader", Loader)]
    reg._plugin, reg._distribution = "atk", "atk-plugin"
    for slot, name, factory in added:
        reg.add(slot, name, factory, options=FaultOptions, doc="misbehaves on request")
    try:
        prep = prepare(str(tiny_config()), overrides, validate_data=True, dry_run=True)
        info = distributed.init("cpu")
        with pytest.raises(PluginError) as e:
            assemble(prep, info, distributed.ControlPlane(info), initial_load=False)
        one_line(e, words)
    finally:
        for slot, name, _ in added:
            del reg._components[slot][name]


class Builds(Model):
    """A model spec that counts its builds."""

    count = 0

    def build(self):
        Builds.count += 1
        return super().build()


class Resizing:
    """A precision whose check_model changes the meta model it was handed, when its ``fault`` asks."""

    def __init__(self, options):
        from plugins.precision.basic import FP32, FP32Options

        self.fault, self.base = options.fault, FP32(FP32Options())
        self.name, self.param_dtype = "atk_precision", None

    def __getattr__(self, name):  # supported, convert, autocast, metrics: fp32's
        return getattr(self.base, name)

    def check_model(self, model):
        if self.fault == "mutate":
            model[1].weight = __import__("torch").nn.Parameter(model[1].weight.new_empty(3, 3))


@pytest.mark.parametrize("fault", ["none", "mutate"])
def test_the_meta_model_is_built_once_and_a_precision_check_only_reads_it(tmp_path, tiny_config, fault):
    """The precision's check_model, the host-memory check and the resume candidates share one build of
    the meta model, so a check that changed it would change what the later checks see: that is
    refused, naming the plugin."""
    reg = registry_mod.load()
    added = [("model", "atk_builds", Builds), ("precision", "atk_precision", Resizing)]
    reg._plugin, reg._distribution = "atk", "atk-plugin"
    for slot, name, factory in added:
        reg.add(slot, name, factory, options=FaultOptions, doc="counts or misbehaves")
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'extends = "{tiny_config()}"\n[model]\nname = "atk_builds"\n[precision]\nname = "atk_precision"\nfault = "{fault}"\n')
    Builds.count = 0
    try:
        if fault == "mutate":
            with pytest.raises(PluginError) as e:
                prepare(str(cfg), [], validate_data=True, dry_run=False, lock=False)
            one_line(e, "precision 'atk_precision': check_model changed the model it was given; a check only reads it")
        else:
            prepare(str(cfg), [], validate_data=True, dry_run=False, lock=False)
            assert Builds.count == 1
    finally:
        for slot, name, _ in added:
            del reg._components[slot][name]


# --- a loader of a plugin's own (not IndexedLoader): what the core reads off it ------------------


class OwnLoader:
    """A loader written from ``core.contract.protocols.DataLoaderLike`` alone: its state has no
    ``consumed_samples``, and it ends after ``n`` micro-batches (a small validation split)."""

    def __init__(self, n: int) -> None:
        self.n, self.position = n, 0

    def __iter__(self):
        import torch

        while self.position < self.n:
            self.position += 1
            yield torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_a_resume_says_where_a_loader_of_its_own_continues(capsys):
    """The core read ``consumed_samples`` off every loader's state, a key no protocol declared: a
    plugin's own loader (its state saved from rank 0, the same on every rank) was reported as
    "per-rank stream positions". The key is declared now (``loader_consumed_samples``)."""
    from types import SimpleNamespace

    from core.checkpoint.resume import say_restored

    state = SimpleNamespace(run=SimpleNamespace(step=3, tokens_seen=12), optimizer=SimpleNamespace(param_groups=[{"lr": 0.1}]), loader=OwnLoader(5))
    say_restored("ckpt", {"world_size": 2}, set(), state, 2)
    out = capsys.readouterr().out
    assert "data at the loader's saved position" in out and "per-rank" not in out, out
    state.loader.state_dict = lambda: {"consumed_samples": 40, "position": 3}
    say_restored("ckpt", {"world_size": 2}, set(), state, 2)
    assert "data at sample 40" in capsys.readouterr().out


def test_a_validation_loader_that_ends_early_is_averaged_or_named(capsys):
    """A plugin's validation split smaller than ``validation.batches`` micro-batches is no bare
    StopIteration: the ranks agree to average the batches every rank served, with one warning; none served is one line."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from core.config.sections import ValidationOptions
    from core.contract.protocols import DistInfo
    from core.loop.validation import evaluate
    from core.runtime import distributed

    class Loss(torch.nn.Module):
        def forward(self, ids, labels):
            return torch.tensor(2.5)

    class Source:
        def __init__(self, n: int) -> None:
            self.n = n

        def loader(self, spec):
            assert spec.split == "val" and spec.grad_accum == 1
            return OwnLoader(self.n)

    def trainer(n: int):
        return SimpleNamespace(
            train_model=Loss(),
            dist=DistInfo(),
            control=distributed.ControlPlane(DistInfo()),  # one rank: the agreement is its own
            run=SimpleNamespace(step=10),
            c={"precision": SimpleNamespace(autocast=lambda device: contextlib.nullcontext()), "data": Source(n)},
            rc=SimpleNamespace(slots={"data": SimpleNamespace(component=SimpleNamespace(name="mine"))}),
            loader_spec=LoaderSpec(seq_len=4, micro_batch=1, grad_accum=2, dp_rank=0, dp_size=1, seed=0),
            signals=SimpleNamespace(received=None),
        )

    assert evaluate(trainer(1), ValidationOptions(every=10, batches=3)) == 2.5
    assert "data 'mine': the validation loader (split 'val') ended after 1 of validation.batches = 3" in capsys.readouterr().err
    with pytest.raises(DataError) as err:
        evaluate(trainer(0), ValidationOptions(every=10, batches=3))
    one_line(err, "data 'mine': the validation loader (split 'val') served no micro-batch")


@pytest.mark.parametrize(
    "batch, words",
    [
        (
            "inputs and labels of seq_len + 1",
            "its loader yielded (1, 5) torch.int64, (1, 5) torch.int64; expected (inputs, labels), two integer tensors of shape (1, 4)",
        ),
        ("float inputs", "its loader yielded (1, 4) torch.float32, (1, 4) torch.int64"),
        ("a bare tensor", "its loader yielded Tensor; expected (inputs, labels)"),
    ],
)
def test_a_loader_of_its_own_is_held_to_the_declared_batch_shape(batch, words):
    """A plugin's own loader that yields [micro_batch, seq_len + 1] rows, labels equal to the inputs or
    float ids is never trained on: each step's micro-batches are held to DataLoaderLike's shape, one
    line, exit 2."""
    from types import SimpleNamespace

    import torch

    from core.data.step_batches import StepBatches

    ids = torch.zeros(1, 4, dtype=torch.long)
    yielded = {
        "inputs and labels of seq_len + 1": (torch.zeros(1, 5, dtype=torch.long),) * 2,
        "float inputs": (ids.float(), ids),
        "a bare tensor": ids,
    }[batch]
    state = SimpleNamespace(loader=OwnLoader(1), run=None)
    dist = SimpleNamespace(rank=0, world_size=1)
    fetch = StepBatches(state, 1, None, dist, "mine", SimpleNamespace(data_wait_s=0.0))
    spec = LoaderSpec(seq_len=4, micro_batch=1, grad_accum=1, dp_rank=0, dp_size=1, seed=0)
    assert fetch.fetch(iter([(ids, ids)]), spec) == ([(ids, ids)], "")  # the declared shape passes
    with pytest.raises(PluginError) as err:
        fetch.fetch(iter([yielded]), spec)
    one_line(err, f"data 'mine': {words}")


class Preflight:
    """A monitor that keeps what ``plait_preflight`` gave it."""

    seen: list = []

    def __init__(self, options):
        pass

    @hookimpl
    def plait_preflight(self, prep, force):
        Preflight.seen.append((prep, force))


def test_plait_preflight_receives_a_prepared_run(tiny_config):
    """``prep`` is a ``core.api.PreparedRun``: the numbers the preparation derived, the resolved config,
    the model spec and the declared tokenizer, read-only; plait's own state stays its own."""
    reg = registry_mod.load()
    reg._plugin, reg._distribution = "atk", "atk-plugin"
    reg.add("monitor", "atk_preflight", Preflight, doc="keeps what plait_preflight gave it")
    Preflight.seen.clear()
    try:
        prepared = plan(tiny_config(), '--monitors.enabled=["atk_preflight"]', "--budget.force=true")
    finally:
        del reg._components["monitor"]["atk_preflight"]
    [(prep, force)] = Preflight.seen
    assert type(prep) is PreparedRun and force is True
    assert (prep.world_size, prep.device, prep.grad_accum, prep.tokens_per_step, prep.total_steps) == (
        prepared.world_size,
        prepared.device,
        prepared.grad_accum,
        prepared.tokens_per_step,
        prepared.total_steps,
    )
    assert prep.resolved == prepared.resolved and prep.resolved["train"]["steps"] == 6
    assert prep.spec is prepared.components["model"] and isinstance(prep.spec, SLOT_PROTOCOLS["model"])
    assert prep.tokenizer == prepared.tokenizer
    assert {f.name for f in dataclasses.fields(PreparedRun)} == {
        "world_size", "device", "grad_accum", "tokens_per_step", "total_steps", "resolved", "spec", "tokenizer"
    }  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        prep.total_steps = 1  # type: ignore[misc]
