"""Checkpoint integrity and safety: checksums in the manifest, fallback on any damage, no code from a checkpoint.

One 2-rank run (checkpoints at steps 4, 6, 8) is shared by the module; each
test damages a copy of it the way a disk, a buggy writer or an attacker would.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run_module, torchrun, write_tiny_config
from shared import RunsAShellCommand, craft_metadata, recommit

from core.checkpoint.folders import checksum_file

pytestmark = pytest.mark.slow

STEP = "checkpoints/step_{:09d}"


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """(config, a 2-rank run with checkpoints 4, 6 and 8, its losses)."""
    tmp = tmp_path_factory.mktemp("integrity")
    cfg = write_tiny_config(tmp, steps=8, global_batch_tokens=1024)
    out = tmp / "run"
    proc = torchrun(2, "--config", str(cfg), f"--train.output_dir={out}", "--checkpoint.every=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cfg, out, {r["step"]: r["loss"] for r in read_metrics(out)}


@pytest.fixture
def run(shared, tmp_path) -> Path:
    """A private copy of the shared run, to damage."""
    copy = tmp_path / "run"
    shutil.copytree(shared[1], copy)
    return copy


def ckpt(run: Path, step: int) -> Path:
    return run / STEP.format(step)


def flip_bytes(file: Path, at: float = 0.5) -> None:
    data = bytearray(file.read_bytes())
    i = int(len(data) * at)
    data[i : i + 8] = bytes(b ^ 0xFF for b in data[i : i + 8])
    file.write_bytes(bytes(data))


def craft_bytes_item(folder: Path, marker: Path) -> str:
    """Point a non-tensor item (an optimizer hyperparameter) at a torch.save of a shell command."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from core.checkpoint.safe_dcp import load_metadata

    meta = load_metadata(folder)
    index = next(i for i in meta.storage_data if i.fqn == "optimizer.param_groups.0.lr")
    shard = folder / meta.storage_data[index].relative_path
    payload = io.BytesIO()
    torch.save(RunsAShellCommand(marker), payload)
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(payload.getvalue())
    meta.storage_data[index] = _StorageInfo(shard.name, offset, len(payload.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    recommit(folder)
    return shard.name


def train_here(cfg: Path, run: Path, *extra: str) -> tuple[int, str, str]:
    """core.train in this process (one rank: no process group to isolate): (exit code, stdout, stderr)."""
    from core.cli.train import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(["--config", str(cfg), f"--train.output_dir={run}", *extra])
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def warnings_in(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("plait: warning:")]


def test_manifest_holds_checksums_of_every_file(run):
    folder = ckpt(run, 8)
    manifest = json.loads((folder / "COMMITTED").read_text())
    assert manifest["checksum"] == "crc32"
    assert (
        set(manifest["checksums"])
        == set(manifest["files"])
        >= {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.json", "rng/rank_0.json", "rng/rank_1.json"}
    )
    for name, value in manifest["checksums"].items():  # the shards' were computed while writing, on each rank
        assert checksum_file(folder / name) == value, name


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("shard", "__1_0.distcp does not match its checksum"),
        ("metadata", ".metadata does not match its checksum"),
        ("state_keys", "state.json lacks 'lr_schedule'"),
        ("negative_step", "state.json: 'step' is -5, expected a non-negative count"),
    ],
)
def test_damaged_newest_falls_back_with_one_warning(shared, run, damage, expected):
    cfg, _, straight = shared
    newest = ckpt(run, 8)
    if damage == "shard":  # same size: only a checksum sees it
        flip_bytes(newest / "__1_0.distcp")
        damaged = (newest / "__1_0.distcp").read_bytes()
    elif damage == "metadata":
        flip_bytes(newest / ".metadata", at=0.7)
    else:  # valid JSON, written and committed as it is (a writer bug)
        state = json.loads((newest / "state.json").read_text())
        if damage == "state_keys":
            del state["lr_schedule"]
        else:
            state["step"] = -5
        (newest / "state.json").write_text(json.dumps(state))
        recommit(newest)
    code, out, err = train_here(cfg, run, "--train.steps=8")
    assert code == 0, err[-2000:]
    assert len(warnings_in(err)) == 1 and expected in warnings_in(err)[0], err
    assert "step_000000006 at step 6" in out
    if damage == "shard":  # the quick check after each commit would pass it: set aside, so it never outranks this run's saves
        (aside,) = (newest.parent / "abandoned").iterdir()
        assert (aside / newest.name / "__1_0.distcp").read_bytes() == damaged
        assert "the 1 newer checkpoint(s) that could not be resumed (step_000000008 to step_000000008) are moved to" in err
    assert (newest / "COMMITTED").is_file()  # this run's own step 8, saved at the end
    # resumed on one rank from two: the same global samples, so the losses of the straight run
    resumed = {r["step"]: r["loss"] for r in read_metrics(run)}
    assert resumed[7] == pytest.approx(straight[7], rel=2e-5) and resumed[8] == pytest.approx(straight[8], rel=2e-5)


def test_every_checkpoint_damaged_says_it_starts_fresh(shared, run):
    for step in (4, 6, 8):
        flip_bytes(ckpt(run, step) / "__0_0.distcp")
    code, out, err = train_here(shared[0], run, "--train.steps=1")
    assert code == 0, err[-2000:]
    lines = warnings_in(err)
    assert len(lines) == 4 and "no usable checkpoint" in lines[-1] and "starting fresh" in lines[-1], err
    assert "resumed from" not in out


def test_explicit_damaged_path_exits_2_with_one_line(shared, run, tmp_path):
    newest = ckpt(run, 8)
    flip_bytes(newest / "__0_0.distcp")
    proc = run_module("core.train", "--config", str(shared[0]), f"--train.output_dir={tmp_path / 'x'}", f"--checkpoint.resume={newest}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"plait: error: checkpoint {newest}: __0_0.distcp does not match its "
        f"checksum (crc32 {checksum_file(newest / '__0_0.distcp')}, expected "
        f"{json.loads((newest / 'COMMITTED').read_text())['checksums']['__0_0.distcp']}): corrupt"
    ]


def test_manifest_without_checksums_is_size_checked_with_one_warning(shared, run, monkeypatch):
    monkeypatch.setattr("core.checkpoint.folders._warned_size_only", False)  # once per process: this test's process
    for step in (6, 8):  # written by an older plait: sizes only
        marker = ckpt(run, step) / "COMMITTED"
        manifest = json.loads(marker.read_text())
        del manifest["checksum"], manifest["checksums"]
        marker.write_text(json.dumps(manifest))
    code, out, err = train_here(shared[0], run, "--train.steps=8")
    assert code == 0, err[-2000:]
    lines = warnings_in(err)
    assert len(lines) == 1 and "no checksums" in lines[0] and "only file sizes are checked" in lines[0], err
    assert "step_000000008 at step 8" in out


def exits_2_with_one_line(main, args: list[str]) -> str:
    """Run an entry point in this process; it must exit with 2 and write one line: that line."""
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2, err.getvalue()
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_crafted_metadata_runs_nothing(shared, run, tmp_path):
    from core.cli.export import main as export_main
    from core.cli.report import main as report_main

    marker = tmp_path / "pwned"
    newest = ckpt(run, 8)
    craft_metadata(newest, marker)
    refused = f"{newest / '.metadata'} refers to posix.system"
    assert refused in exits_2_with_one_line(export_main, ["--checkpoint", str(newest), "--format", "hf", "--out", str(tmp_path / "e")])
    assert refused in exits_2_with_one_line(report_main, ["--run", str(run), "--out", str(tmp_path / "r")])
    code, _, err = train_here(shared[0], tmp_path / "fresh", f"--checkpoint.initial_load={newest}")
    assert code == 2 and len(err.strip().splitlines()) == 1 and refused in err, err
    proc = run_module("core.train", "--config", str(shared[0]), f"--train.output_dir={tmp_path / 'x'}", f"--checkpoint.resume={newest}")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and refused in proc.stderr, proc.stderr
    code, out, err = train_here(shared[0], run, "--train.steps=7")
    assert code == 0, err[-2000:]
    assert len(warnings_in(err)) == 1 and refused in warnings_in(err)[0], err
    assert "step_000000006 at step 6" in out
    assert not marker.exists()


def test_crafted_bytes_item_runs_nothing(shared, run, tmp_path):
    cfg, _, straight = shared
    marker = tmp_path / "pwned"
    newest = ckpt(run, 8)
    shard = craft_bytes_item(newest, marker)
    refused = f"{newest / shard} (item 'optimizer.param_groups.0.lr') holds posix.system"
    proc = run_module("core.train", "--config", str(cfg), f"--train.output_dir={tmp_path / 'x'}", f"--checkpoint.resume={newest}")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and refused in proc.stderr, proc.stderr
    # found while loading, after the model was partly loaded: the state is built afresh before step 6 loads
    code, out, err = train_here(cfg, run, "--train.steps=8")
    assert code == 0, err[-2000:]
    assert len(warnings_in(err)) == 1 and refused in warnings_in(err)[0], err
    assert "step_000000006 at step 6" in out
    resumed = {r["step"]: r["loss"] for r in read_metrics(run)}
    assert resumed[7] == pytest.approx(straight[7], rel=2e-5) and resumed[8] == pytest.approx(straight[8], rel=2e-5)
    assert not marker.exists()


def test_metadata_naming_a_shard_outside_its_folder_is_refused(shared, run, tmp_path):
    """A .metadata whose shard names lead out of the checkpoint folder (here to a copy of a good shard
    one level up, which would load) is refused before anything is read, wherever it is loaded."""
    from core.checkpoint.safe_dcp import load_metadata
    from core.cli.export import main as export_main

    newest = ckpt(run, 8)
    meta = load_metadata(newest)
    index = next(iter(meta.storage_data))
    info = meta.storage_data[index]
    shutil.copy(newest / info.relative_path, run / "outside.distcp")
    for i, other in meta.storage_data.items():
        if other.relative_path == info.relative_path:
            meta.storage_data[i] = type(other)("../outside.distcp", other.offset, other.length)
    (newest / ".metadata").write_bytes(pickle.dumps(meta))
    recommit(newest)
    refused = f"{newest / '.metadata'} names the shard file '../outside.distcp': expected a file name inside {newest}"
    assert refused in exits_2_with_one_line(export_main, ["--checkpoint", str(newest), "--format", "hf", "--out", str(tmp_path / "e")])
    code, _, err = train_here(shared[0], tmp_path / "x", f"--checkpoint.resume={newest}")
    assert code == 2 and len(err.strip().splitlines()) == 1 and refused in err, err


def test_load_failing_half_way_then_starting_fresh_is_fresh(shared, run, tmp_path):
    """The refused item comes after the model's tensors were loaded: starting fresh must build the state again."""
    cfg, _, straight = shared
    for step in (4, 6):
        shutil.rmtree(ckpt(run, step))
    craft_bytes_item(ckpt(run, 8), tmp_path / "pwned")
    (run / "metrics.jsonl").unlink()
    code, out, err = train_here(cfg, run, "--checkpoint.at_end=false")
    assert code == 0, err[-2000:]
    lines = warnings_in(err)
    assert len(lines) == 2 and "holds posix.system" in lines[0] and "starting fresh" in lines[1], err
    fresh = {r["step"]: r["loss"] for r in read_metrics(run)}
    assert [fresh[s] for s in range(1, 9)] == pytest.approx([straight[s] for s in range(1, 9)], rel=2e-5)


def test_two_ranks_agree_on_failures_found_after_the_process_group_exists(shared, run, tmp_path):
    """Step 8 fails while loading (a refused item, on both ranks), step 6 in a file only rank 1
    reads (its RNG state: valid JSON, committed as it is); both ranks go back to step 4."""
    cfg, _, straight = shared
    marker = tmp_path / "pwned"
    craft_bytes_item(ckpt(run, 8), marker)
    (ckpt(run, 6) / "rng" / "rank_1.json").write_text("{}")
    recommit(ckpt(run, 6))
    proc = torchrun(2, "--config", str(cfg), f"--train.output_dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = warnings_in(proc.stderr)
    assert len(lines) == 2, proc.stderr
    assert "holds posix.system" in lines[0] and f"{ckpt(run, 6) / 'rng' / 'rank_1.json'} is not an RNG state" in lines[1]
    assert "step_000000004 at step 4" in proc.stdout
    resumed = {r["step"]: r["loss"] for r in read_metrics(run)}
    assert [resumed[s] for s in (5, 6, 7, 8)] == [straight[s] for s in (5, 6, 7, 8)]  # bitwise: same world size
    assert not marker.exists()


def test_two_ranks_explicit_path_damaged_in_a_shard_is_one_error_line(shared, run, tmp_path):
    """The shards are checked after the process group exists, each rank a share: rank 0 alone says why."""
    newest = ckpt(run, 8)
    flip_bytes(newest / "__1_0.distcp")
    proc = torchrun(2, "--config", str(shared[0]), f"--train.output_dir={tmp_path / 'x'}", f"--checkpoint.resume={newest}")
    assert proc.returncode != 0  # torchrun turns a child's exit code 2 into 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("plait: error:")]
    assert errors == [
        f"plait: error: checkpoint {newest}: __1_0.distcp does not match its checksum "
        f"(crc32 {checksum_file(newest / '__1_0.distcp')}, expected "
        f"{json.loads((newest / 'COMMITTED').read_text())['checksums']['__1_0.distcp']}): corrupt"
    ], proc.stderr
    assert "Traceback" not in proc.stdout


def test_a_checkpoint_in_a_newer_format_is_refused_not_skipped(shared, run):
    """A plait rolled back (an older image after a restart) met checkpoints a newer plait wrote in a
    layout it does not know. Read as damage, ``resume = "auto"`` fell back past them, or started fresh
    and set them aside. Now state.json carries the format; a newer one is one line, exit 2, untouched."""
    newest = ckpt(run, 8)
    state = json.loads((newest / "state.json").read_text())
    assert state["format"] == 1  # what this plait writes
    state["format"], state["versions"]["plait"] = 2, "9.0"
    (newest / "state.json").write_text(json.dumps(state))
    (newest / "COMMITTED").write_text('{"layout": "of plait 9"}')  # a manifest this plait cannot read
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    code, out, err = train_here(shared[0], run, "--train.steps=8")
    assert code == 2, err[-2000:]
    assert err.strip().splitlines() == [
        f"plait: error: checkpoint {newest} is in checkpoint format 2, written by plait 9.0; this plait reads format 1 and older: "
        "resume it with a plait at least as new"
    ]
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing moved aside or written


def nested_json(folder: Path) -> None:
    (folder / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    recommit(folder)


def huge_size(folder: Path) -> None:
    manifest = json.loads((folder / "COMMITTED").read_text())
    (folder / "COMMITTED").write_text(json.dumps(manifest).replace(f'"state.json": {manifest["files"]["state.json"]}', '"state.json": 1e400', 1))


def state_fifo(folder: Path) -> None:
    (folder / "state.json").unlink()
    os.mkfifo(folder / "state.json")


def lineage_bit_flip(folder: Path) -> None:
    data = bytearray((folder / "LINEAGE").read_bytes())
    data[0] ^= 0x80  # one flipped bit: a hex digit becomes a byte that is not UTF-8
    (folder / "LINEAGE").write_bytes(bytes(data))


def lineage_not_text(folder: Path) -> None:
    state = json.loads((folder / "state.json").read_text())
    state["train"]["lineage"] = 5  # valid JSON, committed as it is (a writer bug)
    (folder / "state.json").write_text(json.dumps(state))
    recommit(folder)


@pytest.mark.parametrize(
    "damage, expected",
    [
        pytest.param(lineage_bit_flip, "step_000000008/LINEAGE is damaged (not a run's id)", id="lineage_bit_flip"),
        pytest.param(huge_size, "COMMITTED is corrupt (the size of 'state.json' is inf, expected a count of bytes)", id="huge_size"),
        pytest.param(nested_json, "state.json is corrupt (nested too deeply to be JSON a save writes)", id="nested_json"),
        pytest.param(state_fifo, "step_000000008 is missing state.json", id="state_fifo"),
        pytest.param(lineage_not_text, "state.json: 'train' 'lineage' is 5, expected the run's id", id="lineage_not_text"),
    ],
)
def test_damaged_or_crafted_small_files_are_skipped_with_one_line_never_a_traceback_or_a_hang(shared, run, damage, expected):
    """The small files of the newest checkpoint damaged or crafted past what a checksum catches: a bit
    flipped in LINEAGE (read to pick the run's checkpoints before any checksum), a huge number in the
    manifest, a state.json nested without end or whose train state holds a lineage that is not text,
    a FIFO in place of state.json. Each is damage like any other: one line and the checkpoint before
    it, never a traceback a launcher restarts into, nor a start blocked on the FIFO."""
    damage(ckpt(run, 8))
    proc = run_module("core.train", "--config", str(shared[0]), f"--train.output_dir={run}", "--train.steps=7", "--checkpoint.at_end=false", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = warnings_in(proc.stderr)
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "step_000000006 at step 6" in proc.stdout
