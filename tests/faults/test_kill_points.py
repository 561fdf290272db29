"""SIGKILL at each named point of a save, of one rank or of the whole job, sync and async: the restart
resumes from the last committed checkpoint, loses no committed checkpoint, leaves none poisoned, and
trains to the same losses as an uninterrupted run, bitwise.

Each case is a real 2-rank torchrun job (gloo, the debug llama3), killed inside its save of step 4 (pruning: of step 6, which prunes step 2) by
the ``PLAIT_TEST_KILL_AT`` seam (``tests/seams``), then restarted with the same command. The points
are where a save can be cut: the step folder claimed, in the middle of a shard, between the shards
and ``.metadata``, ``state.json`` written, the marker's temporary written, the marker in place, in
the middle of pruning an older checkpoint. The bitwise comparison is with an uninterrupted run of the
same config (same world size, same seed); every committed checkpoint is checked (``verify`` with the
shards' checksums, and a full DCP load) after the kill and after the restart. One case runs by
default; the others are ``pytest -m bench``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, env, read_metrics, torchrun, torchrun_argv, write_tiny_config

from bench.chaos import usable

pytestmark = pytest.mark.slow

STEPS, EVERY, KILLED_SAVE = 8, 2, 4
POINTS = ["claimed", "shard", "metadata", "state", "marker", "committed", "pruning"]
DEFAULT = ("marker", "sync", "all")  # in CI: the commit's last moment, the whole job gone


def cases() -> list:
    params = []
    for point in POINTS:
        for mode in ("sync", "async"):
            for who in ("all", "rank"):
                if point == "pruning" and who == "rank":
                    continue  # rank 0 prunes alone: killing it is killing "rank"; one case is enough
                marks = () if (point, mode, who) == DEFAULT else (pytest.mark.bench,)
                params.append(pytest.param(point, mode, who, marks=marks, id=f"{point}-{mode}-{who}"))
    return params


def job(cfg: Path, out: Path, async_save: bool, **extra: str) -> subprocess.CompletedProcess:
    """A 2-rank job of ``cfg``. One with a kill point is a real torchrun job (``all`` kills the
    launcher, and the ranks die with it); the others fork from warm interpreters (:mod:`prestarted`,
    whose losses equal real torchrun's bitwise)."""
    args = ["--config", str(cfg), f"--train.output_dir={out}", f"--checkpoint.every={EVERY}", f"--checkpoint.async={str(async_save).lower()}"]
    seams = os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])
    if "PLAIT_TEST_KILL_AT" in extra:
        return subprocess.run(torchrun_argv(2, *args), cwd=REPO, env=env(PYTHONPATH=seams, **extra), capture_output=True, text=True, timeout=600)
    return torchrun(2, *args, timeout=600, extra_env={"PYTHONPATH": seams, **extra})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of a mode, made once when a case first asks for it:
    ``reference(mode) == (config, {step: loss}, [committed step folders])``."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = write_tiny_config(tmp, steps=STEPS, body="[checkpoint]\nkeep_latest = 2\n")
    runs: dict[str, tuple] = {}

    def of(mode: str) -> tuple:
        if mode not in runs:
            out = tmp / mode
            proc = job(cfg, out, mode == "async")
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[mode] = (cfg, {r["step"]: r["loss"] for r in read_metrics(out)}, committed(out))
        return runs[mode]

    return of


def committed(out: Path) -> list[str]:
    root = out / "checkpoints"
    return sorted(p.name for p in root.glob("step_*") if (p / "COMMITTED").is_file())


def last_losses(out: Path) -> dict[int, float]:
    """Each step's loss as the run that went on last logged it (a resume re-logs the steps it redoes)."""
    losses: dict[int, float] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line the kill cut
        if row.get("kind", "train") == "train" and isinstance(row.get("step"), int) and "loss" in row:
            losses[row["step"]] = row["loss"]
    return losses


@pytest.mark.parametrize("point, mode, who", cases())
def test_a_kill_inside_a_save_loses_nothing_committed_and_the_resumed_run_is_bitwise_the_same(reference, tmp_path, point, mode, who):
    cfg, straight, kept = reference(mode)
    out = tmp_path / "out"
    rank = "1" if point == "shard" and who == "rank" else "0"  # a shard of rank 1's; the rest is rank 0's work
    step = KILLED_SAVE + EVERY if point == "pruning" else KILLED_SAVE  # the first save that prunes (keep_latest = 2): step 2 goes
    killed = job(cfg, out, mode == "async", PLAIT_TEST_KILL_AT=f"{point}:{step}:{rank}:{who}")
    assert killed.returncode != 0, killed.stdout[-2000:]
    done = committed(out)
    assert done and done[-1] >= "step_000000002", killed.stderr[-3000:]  # the save before the killed one
    for name in done:
        assert usable(out / "checkpoints" / name) == "", name
    restarted = job(cfg, out, mode == "async")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "Traceback" not in restarted.stdout
    resumed_at = int(done[-1].removeprefix("step_"))
    assert f"resumed from {out / 'checkpoints' / done[-1]} at step {resumed_at}" in restarted.stdout
    assert last_losses(out) == straight  # bitwise: every step, the redone ones included
    assert committed(out) == kept  # nothing committed was lost, no extra left behind
    for name in committed(out):
        assert usable(out / "checkpoints" / name) == "", name
    leftovers = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_") and p.name not in kept)
    assert leftovers == []  # the killed save's folder did not outlive the restart
