"""Finite sources in real 2-rank runs: a streaming run ends cleanly when one rank runs dry first, and a
bad record met by one rank of an indexed source stops every rank at once."""

from __future__ import annotations

import json
import os

from conftest import REPO, read_metrics, torchrun

CORPUS = REPO / "plugins" / "data" / "corpus" / "shakespeare"


def test_streaming_run_ends_cleanly_when_one_rank_runs_dry_first(tiny_config, tmp_path):
    """Rank 0's shard holds more documents than rank 1's: rank 1 runs dry a step earlier.
    Every rank must stop at the same step, save a checkpoint and exit 0 (no hang)."""
    path = tmp_path / "uneven.jsonl"
    docs = [("a" * 300 if i % 2 == 0 else "b" * 100) for i in range(24)]  # even docs (rank 0) are longer
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    cfg = tiny_config(steps=50, body="")
    text = cfg.read_text().replace('name = "token_bin"', 'name = "text_stream"\non_end = "stop"\nfiles = ["%s"]' % path)
    text = text.replace(f'path = "{CORPUS}"\n', "")
    cfg.write_text(text)
    proc = torchrun(2, "--config", str(cfg), "--train.global_batch_tokens=512", "--data.seq_len=64", "--checkpoint.every=0", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = json.loads((tmp_path / "out" / "exit_status.json").read_text())
    assert status["reason"] == "data_end" and status["exit_code"] == 0
    rows = read_metrics(tmp_path / "out")
    last = rows[-1]["step"]
    assert 0 < last < 50 and status["step"] == last
    # rank 1 holds 12 x 101 tokens = 18 windows of 65, 4 per step: it cannot fill step 5
    assert last == (12 * 101) // 65 // 4
    assert (tmp_path / "out" / "checkpoints" / f"step_{last:09d}" / "COMMITTED").exists()


def test_a_bad_record_met_by_one_rank_of_an_index_source_stops_every_rank_at_once(tiny_config, tmp_path):
    """A DataError on one rank of a source whose ranks do not agree on each step's data (an index
    source: no all-reduce before the step). Were that rank to go and save while the other is in the
    step's gradient all-reduce, the collectives would not match (a gloo failure or a hang until a
    timeout, restarted onto the same record). So the rank joins the step with a NaN loss, every rank skips its update and all stop without a
    checkpoint (exit 2, not restarted); the last complete one stays."""
    import subprocess

    from conftest import env, torchrun_argv

    out = tmp_path / "out"
    seams = os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])
    argv = torchrun_argv(2, "--config", str(tiny_config(steps=6)), "--checkpoint.every=2", "--train.collective_timeout_s=60")
    proc = subprocess.run(argv, cwd=REPO, env=env(PYTHONPATH=seams, PLAIT_TEST_BAD_DATA_AT_STEP="3:1"), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    status = json.loads((out / "exit_status.json").read_text())
    assert (status["exit_code"], status["step"], status["reason"]) == (2, 3, "bad_input"), status
    errors = [line for line in proc.stderr.splitlines() if line.startswith("plait: error:")]
    assert any("rank 1: bad data: planted bad record" in line and "this step is skipped on every rank" in line for line in errors), proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*") if (p / "COMMITTED").exists()) == ["step_000000002"]
