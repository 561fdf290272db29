"""Retention in this process: removing a checkpoint never follows a symbolic link, pruning deletes
only what a save wrote, each save records the loss measured on each earlier checkpoint's weights,
and the last sound checkpoint is held while a newer one is unmeasured or diverged."""

from __future__ import annotations


def test_removing_a_checkpoint_never_follows_a_symbolic_link(tmp_path):
    """A user's symlink named like a checkpoint (step_000000004 -> a backup elsewhere): pruning it
    must delete nothing it points to (shutil.rmtree refuses links; a removal file by file would not)."""
    from core.checkpoint.retention import remove

    backup = tmp_path / "backup" / "step_000000004"
    (backup / "rng").mkdir(parents=True)
    for name in ("COMMITTED", "LINEAGE", "__0_0.distcp", "rng/rank_0.json"):
        (backup / name).write_text("kept")
    link = tmp_path / "ckpt" / "step_000000004"
    link.parent.mkdir()
    link.symlink_to(backup, target_is_directory=True)
    remove(link)
    assert sorted(str(p.relative_to(backup)) for p in backup.rglob("*")) == ["COMMITTED", "LINEAGE", "__0_0.distcp", "rng", "rng/rank_0.json"]


def test_pruning_deletes_only_what_a_save_wrote(tmp_path, capsys):
    """A user's notes, or an export made inside a checkpoint folder, were deleted with it when
    pruning removed the folder: plait never deletes what it did not write."""
    from core.checkpoint.retention import remove

    plaits = ["COMMITTED", "LINEAGE", "state.json", ".metadata", "__0_0.distcp", "__1_0.distcp", "rng/rank_0.json", "rng/data_rank_1.json"]
    users = ["notes.txt", "hf/model.safetensors", "rng/my_seed.txt"]
    both, only_plaits = tmp_path / "step_000000004", tmp_path / "step_000000008"
    for folder, names in ((both, plaits + users), (only_plaits, plaits)):
        for name in names:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text("x")
    remove(only_plaits)
    assert not only_plaits.exists()
    remove(both)
    assert sorted(str(p.relative_to(both)) for p in both.rglob("*") if p.is_file()) == sorted(users)
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "plait did not write" in ln]
    assert str(both) in line and "hf/model.safetensors, notes.txt, rng/my_seed.txt" in line, line


def test_each_save_records_the_loss_measured_on_each_earlier_checkpoints_weights(tmp_path):
    """The first loss after a save is that checkpoint's (its weights'); each save carries the ones of
    the checkpoints still on disk, so pruning the save that measured one never loses it."""
    import torch

    from core.checkpoint.retention import LossTally, weights_losses

    tally = LossTally(torch.device("cpu"), None)
    for step in (2, 4):
        (tmp_path / f"step_{step:09d}").mkdir()
    tally.add(torch.tensor(5.0), weights_step=2)
    tally.add(torch.tensor(9.0), weights_step=3)  # not the first since the save: the mean's alone
    assert tally.weights_loss_and_reset(tmp_path, 4) == {"2": 5.0}
    tally.add(torch.tensor(float("nan")), weights_step=4)
    assert tally.weights_loss_and_reset(tmp_path, 6) == {"2": 5.0, "4": None}  # measured, not finite
    (tmp_path / "step_000000002").rmdir()  # pruned: no longer carried
    assert tally.weights_loss_and_reset(tmp_path, 8) == {"4": None}
    states = {
        tmp_path / "step_000000002": {},
        tmp_path / "step_000000004": {"weights_loss": {"2": 5.0}},
        tmp_path / "step_000000006": {"weights_loss": {"2": 5.0, "4": None}},
    }
    assert weights_losses(states) == {tmp_path / "step_000000002": 5.0}  # step 4 and 6: unconfirmed


def test_the_last_sound_checkpoint_is_held_while_a_newer_one_is_unmeasured_or_diverged(tmp_path):
    """retention.held: the newest checkpoint measured sound is kept beyond keep_latest while a newer
    one is unmeasured (not at the end of a run that did not diverge), non-finite or over 20% higher;
    a sound measurement of the newest releases it. Memory's measurements count as the disk's."""
    import torch

    from core.checkpoint.retention import LossTally, held, measurements

    p = [tmp_path / f"step_{s:09d}" for s in (1, 2, 3, 4)]
    assert held(p[:2], {p[0]: 5.0}) == {p[0]}  # step 2 unmeasured: step 1 held
    assert held(p[:2], {p[0]: 5.0}, final=True) == set()  # a run that ends without diverging releases it
    assert held(p[:2], {p[0]: 5.0, p[1]: 4.9}) == set()  # measured sound: released
    assert held(p[:2], {p[0]: 5.0, p[1]: 5.5}) == set()  # noise is no divergence
    assert held(p[:3], {p[0]: 5.0, p[1]: None}, final=True) == {p[0]}  # measured non-finite
    assert held(p[:3], {p[0]: 5.0, p[1]: 6.24, p[2]: 6.24}, final=True) == {p[0]}  # over 20% higher: weights blown up
    assert held(p, {p[0]: 5.0, p[1]: 60.0, p[2]: 4.8}) == {p[2]}  # recovered: the newer sound one is held instead
    assert held(p[:2], {p[0]: None}) == set()  # nothing sound to hold
    states = {p[0]: {}, p[1]: {"weights_loss": {"1": 5.0}}, p[2]: {"weights_loss": {"1": 5.0, "2": None}}}
    assert measurements(states, {3: 4.0, 9: 1.0}) == {p[0]: 5.0, p[1]: None, p[2]: 4.0}
    tally = LossTally(torch.device("cpu"), None)
    assert tally.measure() is None  # nothing taken yet: no collective
    tally.add(torch.tensor(3.0), weights_step=2)
    tally.add(torch.tensor(2.0), weights_step=3)  # taken only once per save
    assert tally.measure() == 2 and tally.measured == {2: 3.0} and tally.measure() is None
    tally.add(torch.tensor(1.0), weights_step=4)
    assert tally.measure() is None  # not armed again until the next save


def test_the_retention_rule_keeps_the_newest_every_nth_step_and_the_pinned_ones():
    from core.checkpoint import retained
    from core.config.sections import CheckpointOptions

    steps = list(range(2, 13, 2))
    assert retained(steps, CheckpointOptions(keep_latest=1, keep_every=4)) == {4, 8, 12}
    assert retained(steps, CheckpointOptions(keep_latest=2)) == {10, 12}
    assert retained(steps, CheckpointOptions(keep_latest=1, keep_every=4), pinned={6}) == {4, 6, 8, 12}
    assert retained(steps, CheckpointOptions(keep_latest=0, keep_every=4)) == set(steps)  # 0 keeps all


def test_the_disk_check_counts_every_checkpoint_the_rule_keeps_at_once():
    """Checkpointer.kept_at_once is never below what retained() holds on the disk while the next save is written."""
    from core.checkpoint import Checkpointer, retained
    from core.config.sections import CheckpointOptions

    for every in (1, 2, 3):
        for keep_latest in (0, 1, 2, 3):
            for keep_every in (0, 2, 4, 5):
                opts = CheckpointOptions(every=every, keep_latest=keep_latest, keep_every=keep_every, keep_lowest_loss=False)
                saves = list(range(every, 25, every))
                held = max(len(retained(saves[: i + 1], opts) | set(saves[max(0, i - 1) : i + 1])) for i in range(len(saves)))
                assert Checkpointer.kept_at_once(opts, 24) >= held, (every, keep_latest, keep_every)
    assert Checkpointer.kept_at_once(CheckpointOptions(every=2, keep_latest=1, keep_every=4, keep_lowest_loss=False), 12) == 2 + 3


def test_two_set_asides_of_one_name_in_one_second_keep_both(tmp_path, monkeypatch):
    """Setting aside what stands at a step's name twice within one second (two saves meeting a file
    there, or a folder renamed beside its root) gives each its own place: neither replaces nor merges
    into the other."""

    from core.checkpoint import retention

    monkeypatch.setattr(retention.time, "strftime", lambda fmt, t=None: "20261202T000000Z")  # one second for all
    root = tmp_path / "checkpoints"
    root.mkdir()
    step = root / "step_000000006"
    places = []
    for text in ("first", "second"):
        step.write_text(text)
        places.append(retention.set_aside(root, [step], "before_step_000000006") / step.name)
    assert [p.read_text() for p in places] == ["first", "second"] and places[0] != places[1]
    for text in ("third", "fourth"):  # renamed beside, as for a folder that cannot leave root
        step.write_text(text)
        monkeypatch.setattr(retention, "set_aside", lambda *a: (_ for _ in ()).throw(PermissionError("no")))
        places.append(retention.set_aside_one(root, step, "before_step_000000006"))
    assert [p.read_text() for p in places] == ["first", "second", "third", "fourth"] and len(set(places)) == 4
    assert all(p.name.endswith("_before_step_000000006") for p in places[2:])
