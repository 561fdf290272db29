"""bench/chaos.py stays runnable: two seeded kills of a real 2-rank job, restarts, the figures."""

from __future__ import annotations

import json

import pytest
from conftest import run_module

pytestmark = [pytest.mark.slow, pytest.mark.bench]  # two seeded kills: minutes on 2 cores, run with `pytest -m bench`


def test_chaos_two_trials(tmp_path):
    """Seed 3 draws a SIGKILL of the whole session and then a Ctrl-C to the process group, both
    shortly after an attempt's first step: the job loses at most one checkpoint interval to the
    SIGKILL, stops cleanly on the Ctrl-C, finishes, and its final loss is bitwise the
    uninterrupted run's; every committed checkpoint loads."""
    out = tmp_path / "chaos.json"
    proc = run_module(
        "bench.chaos",
        "--trials",
        "2",
        "--seed",
        "3",
        "--steps",
        "30",
        "--every",
        "3",
        "--window",
        "1",
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        str(out),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())["figures"]
    assert figures["trials"] == 2 and figures["by_kind"]["sigkill"] == 1 and figures["by_kind"]["ctrl_c"] == 1
    assert figures["unusable_checkpoints"] == 0 and figures["checkpoints_checked"] >= 1
    assert figures["final_loss_equal"] == f"{figures['jobs']}/{figures['jobs']}"
    assert figures["resumes"] >= 1 and figures["hung_attempts"] == 0
    assert figures["clean_signal_stops"] == "1/1" and figures["kills_losing_more_than_interval"] == 0
