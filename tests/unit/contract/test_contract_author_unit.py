"""The plugin contract as a third-party author meets it, in this process: the contract's rule is printed
and a member set to None still counts as declared; a monitor's reduced value that is no number, or that
no reduction can take, is left out (a bad op is the monitor's error)."""

from __future__ import annotations

import pytest

from core.contract.errors import PluginError
from core.contract.members import check_component, describe_contract


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
