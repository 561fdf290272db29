"""Durability inside plait's own Trainer on one CPU process (real DCP checkpoints and files; one
process has no process group to mock): non-finite values never reach weights or checkpoints, a save
calls its named points in order, pruning touches only the run's own verified checkpoints, a commit
and a branch set aside reach the disk before what they replace goes, an async save holds the state
of its step however slow its copy, host memory for async saves is allocated ahead or the save falls
back cleanly, and the guard's and the loss tally's counters equal counting step by step."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from conftest import flat_checkpoint, write_tiny_config
from shared import ckpt_dirs, committed_steps, nonfinite_tensors, trainer_for

pytestmark = pytest.mark.slow


def poison_gradients(model: torch.nn.Module):
    """Every backward fills one weight's gradient with NaN (as an overflow would)."""
    p = next(model.parameters())
    return p.register_hook(lambda g: torch.full_like(g, float("nan")))


# --- non-finite ------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["fused", "foreach"])  # on-device skip (found_inf), host check
def test_nan_gradient_is_never_applied_with_clipping_off(tmp_path, impl):
    cfg = write_tiny_config(tmp_path, steps=4)
    t = trainer_for(cfg, "--train.grad_clip=0", f"--optimizer.impl={impl}", "--checkpoint.at_end=false")
    assert t.guard.on_device == (impl == "fused")
    batches = iter(t.loader)
    t.train_step(t.fetch.fetch(batches, t.built.loader_spec)[0])  # one good step: the optimizer state exists
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    steps_before = [s["step"].clone() for s in t.optimizer.state.values()]
    hook = poison_gradients(t.model)
    loss, grad_norm = t.train_step(t.fetch.fetch(batches, t.built.loader_spec)[0])
    hook.remove()
    assert not torch.isfinite(grad_norm)
    for n, p in t.model.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"{n} changed by a NaN step"
    assert [s["step"] for s in t.optimizer.state.values()] == steps_before
    assert t.guard.read() == (1, 1, 1)
    t.train_step(t.fetch.fetch(batches, t.built.loader_spec)[0])  # training goes on
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


def test_nonfinite_steps_in_a_row_stop_with_exit_3_and_checkpoints_stay_finite(tmp_path):
    cfg = write_tiny_config(tmp_path, steps=20)
    t = trainer_for(cfg, "--checkpoint.every=1", "--train.max_nonfinite_steps=2", "--checkpoint.keep_latest=0")
    t.run.total_steps = 3
    assert t.fit() == 0
    poison_gradients(t.model)
    t.run.total_steps = 20
    code = t.fit()
    status = json.loads((t.output_dir / "exit_status.json").read_text())
    assert code == 3 and status["exit_code"] == 3 and "non-finite" in status["detail"]
    assert status["step"] == 6  # steps 4, 5, 6 skipped: more than 2 in a row
    out = t.output_dir
    assert committed_steps(out) == ["step_000000001", "step_000000002", "step_000000003"]  # none while skipping
    for name in committed_steps(out):
        assert nonfinite_tensors(out / "checkpoints" / name) == 0, name


def test_no_checkpoint_from_nonfinite_parameters(tmp_path, capsys):
    cfg = write_tiny_config(tmp_path, steps=4)
    t = trainer_for(cfg)
    assert t.fit() == 0  # the end-of-run checkpoint, step 4
    with torch.no_grad():
        next(t.model.parameters()).fill_(float("nan"))  # what a diverged update leaves
    assert not t.save_checkpoint(5, use_async=False)
    assert t.run.stop is not None and t.run.stop.exit_code == 3
    assert ckpt_dirs(t.output_dir) == ["step_000000004"]  # nothing written, not even a folder
    err = capsys.readouterr().err
    assert "hold NaN or inf" in err and "step_000000004" in err


def test_loading_a_nonfinite_checkpoint_is_refused(tmp_path):
    from core.contract.errors import CheckpointError

    cfg = write_tiny_config(tmp_path, steps=2)
    t = trainer_for(cfg)
    t.fit()
    with torch.no_grad():
        next(t.model.parameters()).fill_(float("nan"))
    # an older plait wrote such checkpoints: write one the way it did, without the check
    t.checkpointer.contents.check_finite = lambda step, state: None
    t.checkpointer.save(3, use_async=False)
    with pytest.raises(CheckpointError, match="NaN or inf"):
        t.checkpointer.load(t.output_dir / "checkpoints" / "step_000000003")


def test_a_save_calls_its_named_points_in_order(tmp_path):
    """The seams of a save (core.checkpoint.checkpointer) that the kill-point and fault tests act at:
    a sync save and an async one reach every point, in the order of the commit protocol, with the
    marker's text as it lands in COMMITTED."""
    from core.checkpoint.checkpointer import Checkpointer, SavePoints

    seen: list[tuple[str, int]] = []

    class Recorder(SavePoints):
        def started(self, step):
            seen.append(("started", step))

        def claimed(self, step, path):
            seen.append(("claimed", step))

        def before_commit(self, step, path):
            seen.append(("before_commit", step))

        def state_written(self, step, path):
            assert (path / "state.json").is_file() and not (path / "COMMITTED").exists()
            seen.append(("state_written", step))

        def writing_marker(self, step, path, text):
            self.marker = text
            seen.append(("writing_marker", step))

        def committed(self, step, path):
            assert (path / "COMMITTED").read_text() == self.marker
            seen.append(("committed", step))

        def after_commit(self, step, path):
            seen.append(("after_commit", step))

    cfg = write_tiny_config(tmp_path, steps=2)
    t = trainer_for(cfg, "--checkpoint.at_end=false")
    assert t.fit() == 0
    ck = t.checkpointer
    mine = Checkpointer(ck.where, t.built.state, ck.about, points=Recorder())
    mine.save(2, use_async=False)
    mine.save(3, use_async=True)
    mine.wait()
    order = ["started", "claimed", "before_commit", "state_written", "writing_marker", "committed", "after_commit"]
    assert seen == [(p, 2) for p in order] + [(p, 3) for p in order]
    assert committed_steps(t.output_dir) == ["step_000000002", "step_000000003"]


def test_pruning_keeps_verified_own_best_and_foreign_checkpoints(tmp_path):
    from core.checkpoint.folders import LINEAGE_FILE

    cfg = write_tiny_config(tmp_path, steps=8)
    t = trainer_for(cfg, "--checkpoint.keep_latest=0")
    t.run.total_steps = 3
    root = t.checkpointer.root
    for s in (1, 2, 3):
        t.run.total_steps = s
        t.fit()
        t.checkpointer.save(s, use_async=False)
    # another run's checkpoint at a higher step, and a damaged one of ours
    foreign = root / "step_000000009"
    foreign.mkdir()
    (foreign / "COMMITTED").write_text(json.dumps({"step": 9, "files": {}}))
    (foreign / LINEAGE_FILE).write_text("someone-else\n")
    shard = next((root / "step_000000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    t.checkpointer.opts.keep_latest = 2
    t.run.total_steps = 4
    t.fit()
    t.checkpointer.save(4, use_async=False)
    # verified of ours: 1, 2, 4 -> the newest 2 stay; damaged 3 and foreign 9 are not ours to judge
    assert ckpt_dirs(t.output_dir) == ["step_000000002", "step_000000003", "step_000000004", "step_000000009"]


# --- a machine crash ---------------------------------------------------------------------


def record_disk_events(monkeypatch) -> list[tuple[str, str]]:
    """From now on, every fsync (by the path it syncs), rename (by its target), folder removal (``rmtree``,
    or ``rmdir`` of an emptied one) and file removal, in order, as ``(kind, path)``; the real operations still run."""
    import os
    import shutil

    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_rmtree, real_unlink, real_rmdir = os.fsync, os.replace, shutil.rmtree, Path.unlink, Path.rmdir

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        return real_replace(src, dst)

    def rmtree(path, *args, **kwargs):
        events.append(("rmtree", str(path)))
        return real_rmtree(path, *args, **kwargs)

    def unlink(self, *args, **kwargs):
        events.append(("unlink", str(self)))
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)

    def rmdir(self):
        events.append(("rmdir", str(self)))
        return real_rmdir(self)

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(Path, "rmdir", rmdir)
    return events


@pytest.mark.parametrize("async_save", [False, True])
def test_a_commit_reaches_the_disk_before_any_older_checkpoint_goes(tmp_path, monkeypatch, async_save):
    """A power loss or a VM stopped hard loses what the page cache held, and a rename may persist
    before the data it names. So every file a checkpoint holds (shards, .metadata, state.json, RNGs,
    LINEAGE, the marker itself) is fsynced before COMMITTED is renamed into place, the folders'
    entries are fsynced too, and older checkpoints are pruned only after all of that."""
    events = record_disk_events(monkeypatch)
    cfg = write_tiny_config(tmp_path, steps=6)
    t = trainer_for(cfg, "--checkpoint.every=2", "--checkpoint.keep_latest=1", f"--checkpoint.async={str(async_save).lower()}")
    assert t.fit() == 0
    root = (tmp_path / "out" / "checkpoints").resolve()
    commits = [i for i, (kind, path) in enumerate(events) if kind == "replace" and path.endswith("/COMMITTED")]
    assert len(commits) == 3, events  # steps 2, 4, 6
    pruned = [path for kind, path in events if kind in ("rmtree", "rmdir") and Path(path).name.startswith("step_")]
    assert [Path(p).name for p in pruned] == ["step_000000002", "step_000000004"]
    final = root / "step_000000006"
    files = sorted(p for p in final.rglob("*") if p.is_file() and p.name != "COMMITTED")
    assert {p.name for p in files} >= {".metadata", "__0_0.distcp", "state.json", "LINEAGE", "rank_0.json"}
    before = {path for kind, path in events[: commits[-1]] if kind == "fsync"}
    for f in files:
        assert str(f) in before or f"{f}.tmp" in before, f"{f.relative_to(root)} was not on disk before COMMITTED"
    assert {str(final / "COMMITTED.tmp"), str(final), str(final / "rng")} <= before
    for i in commits[:2]:  # after each of the first two commits, one older checkpoint is pruned
        step = Path(events[i][1]).parent
        rm = next(j for j in range(i, len(events)) if events[j][0] in ("rmtree", "rmdir", "unlink"))  # its marker goes first
        synced = {path for kind, path in events[i:rm] if kind == "fsync"}
        assert {str(step), str(root)} <= synced, f"{step.name}'s commit was not on disk before pruning"


def test_setting_a_branch_aside_reaches_the_disk_before_the_marker_goes(tmp_path, monkeypatch):
    """A resume from an older checkpoint moves this run's later ones to abandoned/. The marker that
    names them is on disk before the first move, and the moved folders' new names (in their folder,
    in abandoned/ and in the root) are on disk before the marker is removed."""
    cfg = write_tiny_config(tmp_path, steps=6)
    assert trainer_for(cfg, "--checkpoint.every=2", "--checkpoint.keep_latest=0").fit() == 0
    root = (tmp_path / "out" / "checkpoints").resolve()
    events = record_disk_events(monkeypatch)
    trainer_for(cfg, "--checkpoint.every=2", f"--checkpoint.resume={root / 'step_000000002'}")
    moves = [i for i, (kind, path) in enumerate(events) if kind == "replace" and "/abandoned/" in path]
    assert [Path(events[i][1]).name for i in moves] == ["step_000000004", "step_000000006"]
    dest = Path(events[moves[0]][1]).parent
    before = {path for kind, path in events[: moves[0]] if kind == "fsync"}
    assert {str(root / "SETTING_ASIDE.json"), str(root)} <= before
    gone = next(i for i, (kind, path) in enumerate(events) if kind == "unlink" and path.endswith("SETTING_ASIDE.json"))
    synced = {path for kind, path in events[moves[-1] : gone] if kind == "fsync"}
    assert {str(dest), str(dest.parent), str(root)} <= synced


# --- one writer, and no orphans -------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("adamw8bit", marks=pytest.mark.bench)])  # adamw8bit: CI time
def test_a_slow_async_copy_still_holds_the_state_of_its_step(tmp_path, monkeypatch, optimizer):
    """An async save copies the state in a background thread while the next forward and backward
    run. However slow that copy is, the optimizer waits for it, so the checkpoint holds its own
    step's weights and moments (equal to a sync save's, torchao's 8-bit moments too), and the host
    buffers serve every save."""
    import threading

    from core.checkpoint import staging
    from core.checkpoint.checkpointer import AsyncSaves

    real, real_wait, real_start = staging.HostStager._copy, AsyncSaves.wait_for_copy, AsyncSaves.start
    waiting = threading.Event()  # the training loop has reached the wait for the copy of the save in flight

    def marking_start(self, *args):
        waiting.clear()  # before the copy is asked for: the loop may reach its wait before the copy's thread starts
        return real_start(self, *args)

    def marking_wait(self, step):
        if self.copying is not None:
            waiting.set()
        return real_wait(self, step)

    def slow(self, state):
        # The copy starts only once the loop waits for it, then takes 0.3 s more: the loop waits at least
        # that long, however loaded the machine. Every path that uses the state waits for the copy first;
        # on one that did not, the next update would change the state mid-copy and the checkpoints would
        # differ (the 300 s bound only keeps such a failure from hanging the test).
        waiting.wait(timeout=300)
        time.sleep(0.3)
        return real(self, state)

    monkeypatch.setattr(staging.HostStager, "_copy", slow)
    monkeypatch.setattr(AsyncSaves, "start", marking_start)
    monkeypatch.setattr(AsyncSaves, "wait_for_copy", marking_wait)
    from core.contract import log

    said: list[str] = []  # log's lines, read where they are made (capsys lost a whole run's output in long sequences)
    info = log.info
    monkeypatch.setattr(log, "info", lambda message, all_ranks=False: (said.append(message), info(message, all_ranks)))
    cfg = write_tiny_config(tmp_path, steps=6)
    stagers = []
    for mode in ("true", "false"):
        t = trainer_for(
            cfg,
            f"--optimizer.name={optimizer}",
            "--checkpoint.every=2",
            "--checkpoint.keep_latest=0",
            f"--checkpoint.async={mode}",
            f"--train.output_dir={tmp_path / mode}",
        )
        assert t.fit() == 0
        stagers.append(t.checkpointer.async_saves.stager)
    assert stagers[0] is not None and stagers[0].buffers and stagers[1] is None  # only async saves stage
    assert any(m.startswith("checkpoint step 2: training waited") for m in said), said  # the wait is said, with its length
    for step in ("step_000000002", "step_000000004", "step_000000006"):
        a, b = (flat_checkpoint(tmp_path / mode / "checkpoints" / step) for mode in ("true", "false"))
        flat_a, flat_b = (dict(torch.utils._pytree.tree_flatten_with_path(x)[0]) for x in (a, b))
        assert flat_a.keys() == flat_b.keys()
        for k in flat_a:
            x, y = flat_a[k], flat_b[k]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (step, k)


def test_async_host_buffers_are_allocated_before_the_first_save(tmp_path):
    """Pinning the host buffers of a 1b model's state takes about 10 s: once the optimizer state
    exists, the trainer has them allocated in the background, so the first async save only copies."""
    cfg = write_tiny_config(tmp_path, steps=3)
    t = trainer_for(cfg, "--checkpoint.every=1000", "--checkpoint.at_end=false", "--checkpoint.async=true")
    assert t.fit() == 0 and t.checkpointer.last_saved_step == -1  # no save happened
    stager = t.checkpointer.async_saves.stager
    assert stager is not None
    stager.pool.submit(lambda: None).result()  # the allocation queued before this is done
    tensors = [x for x in torch.utils._pytree.tree_leaves(t.checkpointer.contents.dcp_state()) if isinstance(x, torch.Tensor)]
    assert len(stager.buffers) == len(tensors) > 0
    sync = trainer_for(cfg, "--checkpoint.every=1000", "--checkpoint.at_end=false", f"--train.output_dir={tmp_path / 'sync'}")
    assert sync.fit() == 0 and sync.checkpointer.async_saves.stager is None  # sync saves allocate nothing


def no_host_memory_for_staging(monkeypatch) -> None:
    """Every host buffer the async-save stager asks for fails as torch's CPU allocator fails."""
    from core.checkpoint import staging

    real_empty = torch.empty

    def empty(*args, **kwargs):
        if kwargs.get("device") == "cpu":
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: not enough memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(staging.torch, "empty", empty)


def test_no_host_memory_for_the_async_copy_fails_the_save_cleanly(tmp_path, monkeypatch):
    """Host memory can run out while an async save copies the state (the buffers are as large as
    the state). That save fails like a full disk: SaveFailed with one line naming the tensor and
    what to do, its folder removed, the older checkpoint kept and loadable."""
    from core.checkpoint.folders import SaveFailed, verify

    cfg = write_tiny_config(tmp_path, steps=4)
    assert trainer_for(cfg, "--checkpoint.every=4").fit() == 0  # a good checkpoint at step 4
    no_host_memory_for_staging(monkeypatch)
    from core.checkpoint.checkpointer import Checkpointer

    # no buffers allocated ahead (as for an optimizer without state): the save's own copy fails
    monkeypatch.setattr(Checkpointer, "before_update", Checkpointer.wait_for_staging)
    t = trainer_for(cfg, "--train.steps=10", "--checkpoint.every=4", "--checkpoint.async=true", "--checkpoint.keep_latest=0")
    assert t.run.step == 4  # resumed
    with pytest.raises(SaveFailed) as failed:
        t.fit()  # the async save at step 8 cannot copy the state
    message = str(failed.value)
    assert "no host memory for the async save's copy of" in message and "async = false" in message, message
    assert len(message.splitlines()) == 1
    root = tmp_path / "out" / "checkpoints"
    assert committed_steps(tmp_path / "out") == ["step_000000004"]
    assert not (root / "step_000000008").exists()
    verify(root / "step_000000004")


def test_no_host_memory_for_the_async_buffers_falls_back_to_sync_saves(tmp_path, monkeypatch, capsys):
    """When the host buffers of async saves cannot be allocated ahead of the first save, the run
    does not stop there: it says so once and saves synchronously from then on."""
    no_host_memory_for_staging(monkeypatch)
    cfg = write_tiny_config(tmp_path, steps=6)
    t = trainer_for(cfg, "--checkpoint.every=2", "--checkpoint.async=true", "--checkpoint.keep_latest=0")
    assert t.fit() == 0
    out = capsys.readouterr()
    assert committed_steps(tmp_path / "out") == ["step_000000002", "step_000000004", "step_000000006"]
    said = (out.out + out.err).count("saving synchronously from now on")
    assert said == 1, out
    assert "no host memory for the async save's copy of" in out.out + out.err
    assert "checkpoint step 4: sync save stalled training" in out.out and "async save" not in out.out


def reference_counters(flags: list[int], in_a_row: int) -> tuple[int, int, int]:
    """(skipped, longest run, in a row now) of the steps since a read, counted one by one."""
    skipped, worst = 0, in_a_row
    for f in flags:
        in_a_row = in_a_row + 1 if f else 0
        skipped += f
        worst = max(worst, in_a_row)
    return skipped, worst, in_a_row


def test_guard_counters_equal_counting_step_by_step_across_folds():
    """The guard folds its per-step flags on the device when its buffer fills and at each read;
    random runs of NaN, inf and finite steps, read at random points, count as one by one."""
    from core.contract.protocols import DistInfo
    from core.loop.nonfinite import NonFiniteGuard

    rng = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    guard = NonFiniteGuard(opt, DistInfo(device=torch.device("cpu")), history=3)
    in_a_row, reads = 0, 0
    for _ in range(40):
        n = int(torch.randint(0, 9, (), generator=rng))
        kinds = torch.randint(0, 4, (n,), generator=rng).tolist()  # 0, 1: finite; 2: NaN loss; 3: inf norm
        for k in kinds:
            loss = torch.tensor(float("nan") if k == 2 else 2.5)
            norm = torch.tensor(float("inf") if k == 3 else 1e3)
            assert float(guard.flag(loss, norm)) == float(k >= 2)
        want = reference_counters([int(k >= 2) for k in kinds], in_a_row)
        assert guard.read() == want
        in_a_row, reads = want[2], reads + bool(n)
    assert reads > 30
    # a norm next to float32's largest value counts as non-finite (documented), a large finite one does not
    assert float(guard.flag(torch.tensor(3.0), torch.tensor(3e38))) == 0.0
    assert float(guard.flag(torch.tensor(1e38), torch.tensor(3e38))) == 1.0


def test_loss_tally_mean_counts_finite_losses_across_folds():
    from core.checkpoint.retention import LossTally

    tally = LossTally(torch.device("cpu"), None, history=2)
    for x in [1.0, float("nan"), 3.0, float("inf"), 5.0]:
        tally.add(torch.tensor(x))
    assert tally.mean_and_reset() == 3.0
    assert tally.mean_and_reset() is None
    tally.add(torch.tensor(7.0))
    assert tally.mean_and_reset() == 7.0
