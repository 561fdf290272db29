"""The stop and save policy (core/loop/stop_policy.py) over its whole truth table, in-process."""

from __future__ import annotations

import itertools

import pytest

from core.loop.stop_policy import (
    COMPLETED,
    DATA_END,
    DIVERGED,
    REQUESTED,
    SIGNAL,
    Agreed,
    final_save,
    is_log_step,
    save_due,
    stop_reason,
)


@pytest.mark.parametrize("with_ckpt, without_ckpt, signal, diverged", list(itertools.product([0, 1], [0, 1], [0, 15], [0, 1])))
def test_stop_reason_truth_table(with_ckpt, without_ckpt, signal, diverged):
    agreed = Agreed(with_ckpt, without_ckpt, signal, diverged, exit_code=4)
    got = stop_reason(agreed)
    if diverged:
        assert got == DIVERGED  # never saved, whatever else happened
    elif signal:
        assert got == SIGNAL
    elif with_ckpt or without_ckpt:
        assert got == REQUESTED
    else:
        assert got is None
    assert Agreed.from_list(agreed.as_list()) == agreed  # what the all-reduce carries round-trips


@pytest.mark.parametrize("reason", [COMPLETED, DATA_END, SIGNAL, REQUESTED, DIVERGED])
@pytest.mark.parametrize("at_end, on_stop, wants", list(itertools.product([False, True], repeat=3)))
def test_final_save_truth_table(reason, at_end, on_stop, wants):
    expected = {
        COMPLETED: at_end,
        DATA_END: at_end,
        SIGNAL: on_stop,
        REQUESTED: on_stop and wants,
        DIVERGED: False,
    }[reason]
    assert final_save(reason, at_end, on_stop, wants) is expected


def test_save_and_log_schedules():
    total = 10
    assert [s for s in range(1, total + 1) if save_due(s, 3, total)] == [3, 6, 9]
    assert [s for s in range(1, total + 1) if save_due(s, 5, total)] == [5]  # step 10 is the end-of-run save
    assert not any(save_due(s, 0, total) for s in range(1, total + 1))
    assert [s for s in range(1, total + 1) if is_log_step(s, 4, total)] == [4, 8, 10]
