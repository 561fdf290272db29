"""Which checkpoints stay: the retention rule (:func:`retained`), pruning after each commit, room
made before a save, and the branch an older resume leaves (moved to ``<dir>/abandoned/``, never
deleted). Only this run's own checkpoints, by lineage, are ever touched (rank 0).

A checkpoint's loss is the one measured on its own weights by the first step after it
(:class:`LossTally`, :func:`weights_losses`); with ``keep_measured`` the lowest-loss one is chosen by
it, and the newest sound one is :func:`held` while a newer one is unmeasured or diverged.
``resume = "auto"`` after a diverged attempt (exit 3) goes back to the lowest-loss checkpoint
(:func:`after_divergence`).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Collection

import torch

from core.checkpoint.folders import (
    BEST_FILE,
    COMMIT_MARKER,
    COPY_NAMES,
    LINEAGE_FILE,
    SETTING_ASIDE_FILE,
    STATE_FILE,
    CheckpointOptions,
    committed,
    committed_newest_first,
    lineage_of,
    marked,
    parse_manifest,
    step_dir,
    step_dirs,
    verify,
)
from core.contract import log
from core.contract.errors import CheckpointError, ConfigError
from core.runtime import distributed
from core.runtime.disk import free_bytes, size_text
from core.runtime.durable_io import replace_durable, sync_dir, write_durable
from core.runtime.small_files import read_json

ABANDONED_DIR = "abandoned"


class LossTally:
    """The mean training loss over the steps since the last save, which the save records as
    ``train_loss``: each step's loss is copied into a device buffer (one small kernel, no host
    sync), which is summed on the device when it is full and at the save. It also keeps the first
    of those losses, measured on the weights the last save (or resume) holds: the loss of that
    checkpoint, which each save records with those of the run's other checkpoints still on disk
    (state.json ``weights_loss``, :func:`weights_losses`), so pruning one never loses another's."""

    def __init__(self, device: torch.device, group: Any, history: int = 1024, measure_group: Any = None) -> None:
        self.group = group  # the checkpoint's gloo group (None on one process)
        # measure() runs at step boundaries, beside an async save's collectives on ``group`` (its own thread): not on it
        self.measure_group = group if measure_group is None else measure_group
        self.total = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of finite losses, their count]
        self.losses = torch.zeros(history, dtype=torch.float32, device=device)  # since the last fold
        self.written = 0
        self.first = torch.zeros((), dtype=torch.float64, device=device)  # the first loss since the last save
        self.first_step: int | None = None  # the step of the weights it was measured on, until measure()
        self.armed = True  # the next step's loss is measured on a checkpoint's weights (set by a save, a resume)
        self.measured: dict[int, float | None] = {}  # step -> the loss measured on that checkpoint's weights

    def add(self, loss: torch.Tensor, weights_step: int | None = None) -> None:
        """A step's loss (this rank's), measured on the weights after step ``weights_step``; a
        non-finite one does not count in the mean."""
        if self.written == len(self.losses):
            self.fold()
        self.losses[self.written].copy_(loss.detach())
        self.written += 1
        if self.armed and weights_step is not None:
            self.first.copy_(loss.detach())
            self.first_step, self.armed = weights_step, False

    def resumed(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state.json: the losses it records; the next step measures its weights."""
        self.first_step, self.armed = None, True
        recorded = state.get("weights_loss")
        items = recorded.items() if isinstance(recorded, dict) else ()
        self.measured = {int(k): float(v) for k, v in items if str(k).isdigit() and isinstance(v, (int, float)) and math.isfinite(v)}

    def measure(self) -> int | None:
        """Agree on the loss the first step after the last save measured (the mean over every rank;
        None if not finite on some rank) and keep it in :attr:`measured`; the step of the weights it
        was measured on, or None if there was none to agree on. A collective when one was taken:
        every rank calls it at the same point (each step's boundary, and each save before it makes room)."""
        if self.first_step is None:
            return None
        total, ranks = distributed.agree([float(self.first.item()), 1.0], "sum", self.measure_group)
        step, self.first_step = self.first_step, None
        self.measured[step] = total / ranks if math.isfinite(total) else None
        return step

    def weights_loss_and_reset(self, root: Path, step: int) -> dict[str, float | None]:
        """For the save of ``step`` in ``root``: ``{"<step>": loss}`` for each earlier checkpoint still in
        ``root`` whose weights a step measured (:meth:`measure`, called here too: a collective, every
        rank calls it); the next step's loss is then measured on this save's weights."""
        self.measure()
        self.armed = True
        self.measured = {s: v for s, v in self.measured.items() if s < step and step_dir(root, s).is_dir()}
        return {str(s): v for s, v in sorted(self.measured.items())}

    def fold(self) -> None:
        n, self.written = self.written, 0
        if n:
            seen = self.losses[:n].double()
            finite = torch.isfinite(seen)
            self.total += torch.stack([torch.where(finite, seen, 0.0).sum(), finite.sum(dtype=torch.float64)])

    def mean_and_reset(self) -> float | None:
        """The mean over every rank (a collective: every rank calls it); None if no step counted."""
        self.fold()
        both = self.total.to("cpu", copy=True).tolist()
        self.total.zero_()
        total, count = distributed.agree(both, "sum", self.group)
        return total / count if count > 0 else None


def written_by_a_save(rel: Path) -> bool:
    """A file a save writes, by its path in the step folder: DCP's shards and metadata, ``state.json``,
    each rank's RNG and data position under ``rng/``, ``LINEAGE``, ``COMMITTED``, the tokenizer's
    copy (:mod:`core.checkpoint.folders`), and their temporary files."""
    name = rel.name
    if len(rel.parts) == 2 and rel.parts[0] == "rng":
        return name.endswith((".json", ".tmp"))
    saved = {COMMIT_MARKER, LINEAGE_FILE, STATE_FILE, ".metadata", *COPY_NAMES.values()}
    return len(rel.parts) == 1 and (name in saved or name.endswith((".distcp", ".tmp")))


def _raise(error: OSError) -> None:
    raise error


_SAID_UNDELETABLE: set[Path] = set()  # folders a removal failed in, named once


def remove(path: Path) -> None:
    """Delete one of this run's checkpoint folders so that a kill at any moment leaves this run's
    unfinished folder, which the next prune removes: the ``COMMITTED`` marker goes first (durably: a
    checkpoint never looks complete with files gone), ``LINEAGE`` last. A folder that is a symbolic
    link is left alone: what it points to is not plait's to delete. Only what a save writes is
    deleted: a folder that also holds anything else (a user's notes, an export made there) keeps it,
    loses its ``LINEAGE`` (so it is no longer this run's, and never touched again) and is named in one
    warning. An error (a file that cannot be deleted or a folder that cannot be read: an I/O error, a
    busy mount) stops the removal there, with the folder left uncommitted for the next prune to try
    again: the folder is never removed whole before every file in it was seen to be the save's. That
    error is one warning per folder, and the run goes on."""
    if path.is_symlink():
        return
    kept: list[str] = []
    try:
        (path / COMMIT_MARKER).unlink(missing_ok=True)
        sync_dir(path)
        for folder, dirs, files in os.walk(path, topdown=False, onerror=_raise):  # files before their folders; links not followed
            here = Path(folder)
            for name in files + [d for d in dirs if (here / d).is_symlink()]:
                rel = (here / name).relative_to(path)
                if not written_by_a_save(rel) or (here / name).is_symlink():
                    kept.append(str(rel))
                elif name != LINEAGE_FILE:
                    (here / name).unlink()
            if here != path and not any(here.iterdir()):
                here.rmdir()
    except OSError as e:  # unseen files may be another's: the folder stays, without its marker, for the next prune
        if path not in _SAID_UNDELETABLE:
            _SAID_UNDELETABLE.add(path)
            log.warn(f"could not delete old checkpoint {path} ({e.strerror or e}: {e.filename or path}); it stays, and training goes on")
        return
    if not kept:
        try:
            (path / LINEAGE_FILE).unlink(missing_ok=True)
            path.rmdir()
        except OSError:
            pass
        return
    (path / LINEAGE_FILE).unlink(missing_ok=True)
    shown = ", ".join(sorted(kept)[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
    log.warn(f"{path}: its checkpoint files are deleted, but not what plait did not write there ({shown}): the folder stays")


def own_verified(root: Path, lineage: str) -> dict[Path, dict[str, Any]]:
    """This run's committed checkpoints that verify (without the shards' checksums), oldest
    first, each with its state.json."""
    found = {}
    for path in committed(root):
        if lineage_of(path) != lineage:
            continue
        try:
            found[path] = verify(path, shards=False)
        except (CheckpointError, ConfigError):
            pass  # damaged, or a newer plait's: not ours to judge, never deleted
    return found


def newest_verified(root: Path, lineage: str) -> Path | None:
    """This run's newest committed checkpoint that verifies (as :func:`own_verified` judges), reading
    no older one than it must."""
    for path in committed_newest_first(root):
        if lineage_of(path) != lineage:
            continue
        try:
            verify(path, shards=False)
            return path
        except (CheckpointError, ConfigError):
            pass
    return None


def train_loss(state: dict[str, Any]) -> float | None:
    """The checkpoint's training loss (state.json ``train_loss``), if it has a finite one."""
    loss = state.get("train_loss")
    return float(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) else None


def weights_losses(states: dict[Path, dict[str, Any]]) -> dict[Path, float]:
    """The finite losses of :func:`measurements`: a checkpoint with none is unconfirmed (no later save
    measured it: the newest, or one the run diverged after)."""
    return {p: loss for p, loss in measurements(states).items() if loss is not None}


def measurements(states: dict[Path, dict[str, Any]], memory: dict[int, float | None] | None = None) -> dict[Path, float | None]:
    """The loss measured on each checkpoint's own weights (None: measured non-finite; missing:
    unmeasured). The first step after a save (or a resume) computes its loss on the saved weights and
    each later save records it (state.json ``weights_loss``: ``{"<step>": loss}``, :class:`LossTally`);
    ``memory`` adds this run's measurements not yet saved (step -> loss). ``states``: checkpoints of
    one run with their state.json (either order)."""
    by_step = {step_of(p): p for p in states}
    found: dict[Path, float | None] = {}
    recorded = [state.get("weights_loss") for state in states.values()] + [memory or {}]
    for entries in recorded:
        for key, loss in entries.items() if isinstance(entries, dict) else ():
            path = by_step.get(int(key)) if str(key).isdigit() else None
            if path is None:
                continue
            if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss):
                found[path] = float(loss)
            elif loss is None or isinstance(loss, float):
                found.setdefault(path, None)
    return found


JUMP, JUMP_NATS = 1.2, 0.1  # a measured loss above JUMP times the last sound one's plus JUMP_NATS shows the weights diverged


def held(paths: list[Path], measured: dict[Path, float | None], final: bool = False) -> set[Path]:
    """Of a run's checkpoints ``paths`` (oldest first) with their ``measured`` losses (:func:`measurements`),
    the one kept beyond ``keep_latest``: the newest *sound* one (a finite loss, at most ``JUMP`` times the
    sound one before it plus ``JUMP_NATS``), while a newer one is unmeasured (the newest, until the step after it
    measures it; not when ``final``: the run ended without diverging) or measured unsound. None otherwise."""
    sound: Path | None = None
    diverging = False
    for p in paths:
        if p not in measured:
            continue
        loss = measured[p]
        if loss is not None and (sound is None or loss <= JUMP * (measured[sound] or 0.0) + JUMP_NATS):
            sound, diverging = p, False
        else:
            diverging = True
    if sound is None or sound == paths[-1]:
        return set()
    pending = not final and paths[-1] not in measured
    return {sound} if diverging or pending else set()


def lowest(losses: dict[Path, float]) -> Path:
    """The checkpoint with the lowest of ``losses``; of equal ones, the newest."""
    return min(sorted(losses, key=step_of, reverse=True), key=losses.__getitem__)


def retained(steps: list[int], opts: CheckpointOptions, pinned: Collection[int] = ()) -> set[int]:
    """THE retention rule: of a run's verified checkpoints at ``steps`` (ascending), the steps kept
    after a commit: every one when ``keep_latest = 0``; else the newest ``keep_latest``, every step
    that is a multiple of ``keep_every`` (kept for good), and ``pinned`` (the newest, the ``keep_best``
    ones, the lowest-loss one, the :func:`held` one). Pruning removes the others; so does making room
    before a save (:func:`make_room`); :func:`kept_at_once` sizes the disk by it."""
    if not opts.keep_latest:
        return set(steps)
    keep = set(steps[-opts.keep_latest :]) | (set(steps) & set(pinned))
    if opts.keep_every:
        keep |= {s for s in steps if s % opts.keep_every == 0}
    return keep


def kept_at_once(opts: CheckpointOptions, total_steps: int) -> int:
    """At most how many checkpoints :func:`retained` has on the disk at once over a run of
    ``total_steps`` (the disk-room check, :mod:`core.preflight.start_folders`): the newest
    ``keep_latest`` (at least two: the newest stays while the next is written), every ``keep_every``
    one, the lowest-loss and best ones; every save when ``keep_latest = 0``."""
    saves = (total_steps // opts.every if opts.every else 0) + 1  # the end's, or a stop's
    if not opts.keep_latest:
        return saves
    forever = 0
    if opts.keep_every:
        period = opts.keep_every * opts.every // math.gcd(opts.keep_every, opts.every) if opts.every else opts.keep_every
        forever = total_steps // period
    return min(saves, max(opts.keep_latest, 2) + forever + int(opts.keep_lowest_loss) + opts.keep_best)


class Retention:
    """Pruning of one run's checkpoints in ``root``; remembers what it has said."""

    def __init__(self, root: Path, opts: CheckpointOptions, losses: LossTally | None = None) -> None:
        self.root, self.opts, self.losses = root, opts, losses  # losses: the run's measurements in memory
        self.said_lowest: Path | None = None

    def prune(self, lineage: str, in_flight: Path | None, final: bool = False) -> None:
        """Apply the retention rules after a commit, after a step measured the newest checkpoint, and
        as a run that did not diverge ends (``final``) (rank 0). With ``keep_latest = 0`` every
        checkpoint stays and only the newest sound one is looked for: verifying them all after each
        commit made every save slower than the one before (soak: 2 ms more per checkpoint kept).
        A folder that cannot be read or deleted is one warning; the commit stands and training goes on."""
        try:
            self._prune(lineage, in_flight, final)
        except OSError as e:
            log.warn(f"pruning old checkpoints in {self.root} failed ({e.strerror or e}: {e.filename or self.root}); they stay, and training goes on")

    def _prune(self, lineage: str, in_flight: Path | None, final: bool) -> None:
        if not self.opts.keep_latest:
            if (newest := newest_verified(self.root, lineage)) is not None:
                self.remove_interrupted(lineage, newest, in_flight)
            return
        good = own_verified(self.root, lineage)
        if not good:
            return
        paths = list(good)
        keep = retained([step_of(p) for p in paths], self.opts, {step_of(p) for p in self.pinned(good, say=True, final=final)})
        for old in paths:
            if step_of(old) not in keep:
                remove(old)
        self.remove_interrupted(lineage, paths[-1], in_flight)

    def pinned(self, good: dict[Path, dict[str, Any]], say: bool, final: bool = False) -> set[Path]:
        """Of this run's verified checkpoints ``good`` (oldest first), those :func:`retained` keeps whatever
        their age: the newest, the best ones, the lowest-loss one and, with ``keep_measured``, the :func:`held` one."""
        keep = best_paths(self.root) | {list(good)[-1]}
        measured = measurements(good, self.losses.measured if self.losses is not None else None) if self.opts.keep_measured else {}
        if self.opts.keep_measured:
            keep |= held(list(good), measured, final)
        if self.opts.keep_lowest_loss:
            keep |= self.lowest_loss(good, measured, say)
        return keep

    def remove_interrupted(self, lineage: str, newest: Path, in_flight: Path | None) -> None:
        """This run's interrupted saves older than its newest verified checkpoint ``newest``."""
        for p in step_dirs(self.root):
            if p.name < newest.name and p != in_flight and not marked(p) and lineage_of(p) == lineage:
                remove(p)

    def removed_by_next_prune(self, good: dict[Path, dict[str, Any]]) -> list[Path]:
        """Of this run's verified checkpoints ``good`` (oldest first), those the prune after one more
        commit removes whatever that checkpoint holds, oldest first (:mod:`core.checkpoint.retention`
        removes them early when the disk lacks room for the save). Never the newest: it is the last
        complete one until the next commits."""
        steps = [step_of(p) for p in good]
        pinned = {step_of(p) for p in self.pinned(good, say=False)}  # the next save is unmeasured then: it holds the newest sound one
        keep = retained([*steps, steps[-1] + 1], self.opts, pinned) if steps else set()
        return [p for p in good if step_of(p) not in keep]

    def lowest_loss(self, good: dict[Path, dict[str, Any]], measured: dict[Path, float | None], say: bool = True) -> set[Path]:
        """The checkpoint with the lowest training loss (none if none has one): with ``keep_measured``,
        the loss ``measured`` on its own weights (:func:`measurements`), kept unless it is the newest
        measured one (then no later one measured worse; :func:`held` keeps it while the newer ones are
        unmeasured), else ``train_loss``, the mean of the steps before it. One line when it is kept
        beyond ``keep_latest`` (``say``)."""
        if self.opts.keep_measured:
            losses, on = {p: loss for p, loss in measured.items() if loss is not None}, "measured on its weights"
        else:
            losses, on = {p: loss for p, s in good.items() if (loss := train_loss(s)) is not None}, "the steps before it"
        if not losses:
            return set()
        best = lowest(losses)
        newest = max(losses, key=step_of)
        if self.opts.keep_measured and best == max(measured, key=step_of):
            return set()
        beyond = self.opts.keep_latest and best not in list(good)[-self.opts.keep_latest :]
        if say and beyond and best != self.said_lowest and newest != best:
            log.warn(
                f"checkpoint {best.name} has this run's lowest training loss ({losses[best]:.4g}, {on}; the newest, "
                f"{newest.name}, has {losses[newest]:.4g}): it is kept beyond keep_latest (checkpoint.keep_lowest_loss); "
                f'resume from it with --checkpoint.resume="{best}"'
            )
            self.said_lowest = best
        return {best}


def after_divergence(output_dir: Path, candidates: list[Path]) -> tuple[str, list[Path]] | None:
    """For a ``resume = "auto"`` start from ``candidates`` (newest first) after an attempt whose
    ``exit_status.json`` says exit code 3 (non-finite steps, a lasting change of level the ``spikes``
    monitor stopped on): the candidates from the checkpoint to resume on, and the line that says
    which and why. It is the checkpoint whose own weights measured the lowest loss
    (:func:`weights_losses`; of equal ones the newest): in a run whose loss fell until it diverged,
    the newest saved before the divergence began. The newer ones are left (set aside as a branch,
    :func:`set_aside_later`). Where no checkpoint has a measured loss, the newest is taken and the
    line says that none is known to be from before the divergence. None after any other end."""
    try:
        status = read_json(output_dir / "exit_status.json")
    except (OSError, ValueError):
        return None
    if not isinstance(status, dict) or status.get("exit_code") != 3 or not candidates:
        return None
    states: dict[Path, dict[str, Any]] = {}
    for path in candidates:
        try:
            if isinstance(state := read_json(path / STATE_FILE), dict):
                states[path] = state
        except (OSError, ValueError):
            continue
    measured = weights_losses(states)
    newest = candidates[0]
    why = f"the previous attempt stopped as diverged at step {status.get('step')} ({str(status.get('detail', ''))[:200]})"
    if not measured:
        return (
            f"{why}; no checkpoint is known to be from before the divergence (none has a loss measured on its weights by a "
            f'later step): resume = "auto" takes the newest, {newest.name}, which may hold diverged weights; to start '
            f"afresh instead, move the checkpoints out of {newest.parent}",
            candidates,
        )
    chosen = lowest(measured)
    older = candidates[candidates.index(chosen) :]
    if chosen == newest:
        return (
            f"{why}; resuming from the newest checkpoint, {newest.name}, which also has the lowest loss measured on its weights ({measured[chosen]:.4g})",
            older,
        )
    return (
        f'{why}; resume = "auto" goes back to {chosen.name}, the checkpoint with the lowest loss measured on its weights '
        f"({measured[chosen]:.4g}), from before the divergence; the {candidates.index(chosen)} newer one(s) are set aside; "
        f"to resume another, --checkpoint.resume=<its folder>",
        older,
    )


def best_paths(root: Path) -> set[Path]:
    """The checkpoints ``BEST.json`` lists (``keep_best``)."""
    try:
        return {root / b["path"] for b in read_json(root / BEST_FILE)["best"]}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def write_best(root: Path, ranking: list[list[Any]], metric: str = "val_loss", mode: str = "min") -> None:
    """``BEST.json`` from ``[[key, step], ...]``, best first (key: the metric's value, negated for
    ``mode = "max"``), each entry with the metric's value under its name; replaced atomically."""
    sign = -1 if mode == "max" else 1
    best = [{"step": int(s), "path": step_dir(root, int(s)).name, metric: sign * key} for key, s in ranking]
    replace_durable(root / BEST_FILE, json.dumps({"best": best}, indent=1))


def step_of(path: Path) -> int:
    """The step of a folder named by :func:`core.checkpoint.folders.step_dir`."""
    return int(path.name.removeprefix("step_"))


def later_than(root: Path, lineage: str | None, resumed: Path, step: int) -> list[Path]:
    """This run's verified checkpoints in ``root`` that a resume from ``resumed`` (at ``step``) leaves
    behind: those of a later step, and another folder of the same step (the resumed one is a copy, or
    lies in ``abandoned/``: the one here is of another branch). Wherever ``resumed`` lies, the lineage
    says whose they are. Damaged ones stay out (a save of their step replaces them)."""
    if lineage is None:
        return []
    here = resumed.resolve()
    return [p for p in own_verified(root, lineage) if step_of(p) > step or (step_of(p) == step and p.resolve() != here)]


def set_aside(root: Path, paths: list[Path], label: str) -> Path:
    """Move ``paths`` (folders in ``root``) to ``root/abandoned/<utc>_<label>/``, durably, and return
    that folder. While the moves run, ``SETTING_ASIDE.json`` names them (resume = "auto" skips them).
    Raises OSError if a move fails."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest, n = root / ABANDONED_DIR / f"{stamp}_{label}", 1
    while True:  # a folder of its own: an earlier set-aside of the same second is never merged into or replaced
        try:
            dest.mkdir(parents=True)
            break
        except FileExistsError:
            dest, n = root / ABANDONED_DIR / f"{stamp}_{n}_{label}", n + 1
    marker = root / SETTING_ASIDE_FILE  # a kill inside the loop: resume = "auto" still skips the rest
    write_durable(marker, json.dumps([p.name for p in paths]))
    sync_dir(root)
    for p in paths:
        os.replace(p, dest / p.name)
    sync_dir(dest)
    sync_dir(dest.parent)  # the new folder's own name in abandoned/
    sync_dir(root)
    marker.unlink()
    return dest


def set_aside_one(root: Path, path: Path, label: str) -> Path:
    """Set ``path`` aside (:func:`set_aside`) and return where it went; a folder that cannot leave
    ``root`` (without write permission: a move to another folder rewrites its ``..``, rename(2)) is
    renamed in ``root`` to ``abandoned_<utc>_<label>``, which no checkpoint, nor ``step_*``, names.
    Raises OSError if both fail."""
    try:
        return set_aside(root, [path], label) / path.name
    except PermissionError:
        if not os.path.lexists(path):
            raise
    (root / SETTING_ASIDE_FILE).unlink(missing_ok=True)  # it named ``path`` alone, which is still here
    for made in (root / ABANDONED_DIR).glob(f"*_{label}"):  # the folder it was to go to, left empty
        try:
            made.rmdir()
        except OSError:
            pass
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    beside, n = root / f"{ABANDONED_DIR}_{stamp}_{label}", 1
    while os.path.lexists(beside):  # one set aside earlier in the same second: never replaced, never merged
        beside, n = root / f"{ABANDONED_DIR}_{stamp}_{n}_{label}", n + 1
    os.rename(path, beside)
    sync_dir(root)
    return beside


def settle_set_aside(root: Path) -> None:
    """Drop from ``SETTING_ASIDE.json`` the folders no longer in ``root`` (moved before the kill that
    left the marker), and the marker once it names none (rank 0, before the first step). Left naming a
    moved step, it would hide this run's next save of that step from ``resume = "auto"``."""
    marker = root / SETTING_ASIDE_FILE
    try:
        named = read_json(marker)
    except (OSError, ValueError):
        return
    left = [n for n in named if isinstance(n, str) and (root / n).is_dir()] if isinstance(named, list) else []
    if left:
        replace_durable(marker, json.dumps(left))
    else:
        marker.unlink()
        sync_dir(root)


def set_aside_later(root: Path, lineage: str, resumed: Path, step: int, chosen: bool, passed_over: str = "") -> Path | None:
    """Move the checkpoints of this run in ``root`` that a resume from ``resumed`` (at ``step``)
    leaves behind (:func:`later_than`) to ``root/abandoned/<utc>_after_step_<n>/``; return that folder,
    or None if there were none. ``chosen``: ``resumed`` was named (``checkpoint.resume``), rather than reached by
    ``resume = "auto"`` skipping the newer ones as damaged or unloadable; ``passed_over``: why ``resume =
    "auto"`` went back past sound ones (after a diverged attempt, :func:`after_divergence`). Raises OSError if a move fails (the caller stops the run: a new branch beside
    them would lose its saves)."""
    later = later_than(root, lineage, resumed, step)
    if not later:
        return None
    dest = set_aside(root, later, f"after_step_{step:09d}")
    try:  # BEST.json lists only what is still here
        best = read_json(root / BEST_FILE)["best"]
        write_best(root, [[b["val_loss"], b["step"]] for b in best if (root / b["path"]).is_dir()])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none, or not ours to mend
    span = f"{later[0].name} to {later[-1].name}"
    if chosen:
        log.warn(
            f"resumed from {resumed} (step {step}), which is not this run's newest checkpoint: the {len(later)} later one(s) "
            f"({span}) are a branch this run leaves; moved to {dest} (kept, never pruned or resumed from automatically)"
        )
    elif passed_over:  # resume = "auto" went back past them (the start's line says why)
        log.note(f"the {len(later)} newer checkpoint(s) ({span}) {passed_over}: moved to {dest} (kept, never pruned or resumed from automatically)")
    else:  # resume = "auto" skipped them (the warnings above): they must not outrank this run's next saves either
        log.note(f"the {len(later)} newer checkpoint(s) that could not be resumed ({span}) are moved to {dest}")
    return dest


MARGIN = 1.05  # a checkpoint can grow a little from one save to the next (the data state, the JSON parts)


def size_on_disk(path: Path) -> int:
    """The bytes a committed checkpoint's manifest lists."""
    return sum(parse_manifest(path / COMMIT_MARKER).sizes.values())


def make_room(root: Path, retention: Retention, lineage: str, step: int) -> list[str]:
    """Before the save of ``step`` (rank 0, no save in flight): remove early what the next prune
    would remove, oldest first, while the disk lacks room for a checkpoint as large as the newest.
    The names removed, said in one warning line."""
    newest = next((p for p in committed_newest_first(root) if lineage_of(p) == lineage), None)  # not every one's: keep_latest = 0 keeps many
    try:
        needed = int(size_on_disk(newest) * MARGIN) if newest is not None else 0
    except (OSError, ValueError, CheckpointError):
        return []
    free = free_bytes(root)
    if not needed or free is None or free >= needed:
        return []  # the common case: one statfs and one small read
    good = own_verified(root, lineage)
    if not good:
        return []
    newest = list(good)[-1]
    unfinished = [p for p in step_dirs(root) if p.name < newest.name and not (p / COMMIT_MARKER).exists() and lineage_of(p) == lineage]
    removed: list[str] = []
    for old in unfinished + retention.removed_by_next_prune(good):
        remove(old)
        removed.append(old.name)
        free = free_bytes(root) or 0
        if free >= needed:
            break
    if removed:
        enough = "" if free >= needed else f"; still short of room ({size_text(free)} free), the save may fail"
        log.warn(
            f"{root}: {size_text(free)} free after removing {', '.join(removed)} before the save of step {step} "
            f"(a checkpoint takes about {size_text(needed)}; pruning would have removed them after it){enough}"
        )
    return removed
