"""A run's architecture: the model's name and the options its spec declares as defining its function
(``architecture_options``, core/contract/members.py) as saved; a difference names each changed option
and nothing else; a malformed declaration or resolved architecture is the plugin's one-line error;
the built-in specs declare real options (``rope_theta`` is not one, so a context extension still
resumes) and ``core.plugins`` shows them."""

from __future__ import annotations

import pytest

from core.checkpoint.folders import RESOLVED, differences, run_architecture
from core.contract.errors import PluginError
from core.contract.members import check_component
from model_specs.llama3.spec import Llama3Spec
from model_specs.recurrent_moe.spec import RecurrentMoEOptions, RecurrentMoESpec

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
    assert "refused): flavor, dim, ffn_dim, n_prelude, n_core, n_coda, n_loops, n_experts, top_k, vocab_size" in text


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
