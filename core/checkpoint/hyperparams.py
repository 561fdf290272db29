"""On resume, this run's config wins over the checkpoint's optimizer and schedule settings, and
every config value that differs from the checkpoint's is named.

``optimizer.load_state_dict`` (and DCP's ``set_optimizer_state_dict``) restores the
param groups as they were saved: learning rate, betas, weight decay, eps, all of
them, and ``LambdaLR.load_state_dict`` restores the peak learning rates
(``base_lrs``). Without this module an ``--optimizer.lr=1e-4`` given to a resumed
run would be silently ignored. The checkpoint keeps what is state (the moments,
the step counts, the schedule's position); the config keeps what is a setting.
Every setting that differs is named in one line, so a change is never silent; so are
the config values that differ from the checkpoint's config (also shown by ``core.plan``),
a different ``train.seed`` and training data whose fingerprint changed (warnings).
"""

from __future__ import annotations

from typing import Any

import torch

from core.contract import log
from core.contract.protocols import loader_consumed_samples

STATE_KEYS = frozenset({"params", "lr"})  # the parameters, and the LR the schedule sets each step


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups' settings as this run's config made them (call before loading)."""
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k not in STATE_KEYS} for g in optimizer.param_groups]


def reapply(optimizer: torch.optim.Optimizer, before: list[dict[str, Any]]) -> dict[str, tuple[Any, Any]]:
    """Put the config's settings back after a load; ``{key: (checkpoint's, config's)}`` for those that differed
    (one example per key; ``initial_lr`` is the group's peak LR)."""
    changed: dict[str, tuple[Any, Any]] = {}
    if len(before) != len(optimizer.param_groups):
        return changed
    for group, mine in zip(optimizer.param_groups, before):
        for key, value in mine.items():
            loaded = group.get(key)
            if _plain(loaded) != _plain(value):
                changed.setdefault(key, (_plain(loaded), _plain(value)))
                if isinstance(loaded, torch.Tensor) and isinstance(value, torch.Tensor) and loaded.shape == value.shape:
                    loaded.copy_(value)
                else:
                    group[key] = value
    return changed


def next_lrs(scheduler: Any, peaks: list[float], changed: dict[str, tuple[Any, Any]]) -> list[float]:
    """After the schedule's state is loaded (core/loop/assemble.py's ``LambdaLR``): this run's peak LRs back in
    place, and the LRs of the next step, the peak times the multiplier at the restored step."""
    if list(scheduler.base_lrs) != peaks:
        changed.setdefault("initial_lr", (scheduler.base_lrs[0], peaks[0]))
        scheduler.base_lrs = peaks
    lrs = [peak * multiplier(scheduler.last_epoch) for peak, multiplier in zip(peaks, scheduler.lr_lambdas)]
    scheduler._last_lr = lrs
    return lrs


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return str(value)


def say_changes(path: Any, changed: dict[str, tuple[Any, Any]]) -> None:
    if changed:
        parts = ", ".join(f"{'peak lr' if k == 'initial_lr' else k} {_show(old)} -> {_show(new)}" for k, (old, new) in sorted(changed.items()))
        log.note(f"checkpoint {path}: the optimizer settings it holds differ from this run's, which apply from the next step: {parts}")


def seed_changed(path: Any, meta: dict[str, Any], seed: int) -> None:
    """Warn when the seed differs from the checkpoint's: the data order from here on follows the new one."""
    saved = meta.get("config", {}).get("train", {}).get("seed")
    if isinstance(saved, int) and saved != seed:
        log.warn(
            f"checkpoint {path} was trained with train.seed = {saved}, this run uses {seed}: the data order from the "
            f"next step follows seed {seed}, so samples of the current epoch may repeat or be skipped"
        )


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``key old -> new`` for every config value that differs (``train.seed`` has a warning of its own;
    ``checkpoint.resume`` names the checkpoint, so it differs whenever one is named; ``derived`` is not
    config but what plait worked out from it, such as the world size, which the resume names itself)."""
    a, b = _flat(saved), _flat(now)
    ignored = ("train.seed", "checkpoint.resume")
    keys = sorted(k for k in a.keys() | b.keys() if k not in ignored and not k.startswith("derived.") and a.get(k) != b.get(k))
    return [f"{k} {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in keys]


def config_changed(path: Any, meta: dict[str, Any], config: dict[str, Any], shown: int = 8) -> None:
    """One line naming the config values that differ from the ones the checkpoint was saved with."""
    parts = config_differences(meta.get("config") or {}, config)
    if parts:
        more = f" and {len(parts) - shown} more" if len(parts) > shown else ""
        log.note(f"checkpoint {path}: the config differs from the one it was saved with: {', '.join(parts[:shown])}{more}")


def data_changed(path: Any, meta: dict[str, Any], fingerprint: str | None) -> None:
    """Warn when the data source's ``fingerprint()`` differs from the one saved in the checkpoint: the
    restored data position now indexes other data."""
    saved = meta.get("data_fingerprint")
    if saved and fingerprint and saved != fingerprint:
        position = loader_consumed_samples(meta.get("data", {}))
        at = f" (sample {position:,})" if position is not None else ""
        log.warn(
            f"checkpoint {path} was trained on other data ({saved}); this run's data is {fingerprint}: "
            f"the restored data position{at} now indexes different data"
        )


def say_restored(path: Any, meta: dict[str, Any], skip: set[str], state: Any, world_size: int) -> None:
    """Two lines after a resume: where from, and what the restored state (``TrainingState``) holds."""
    from core.contract.protocols import loader_state_per_rank

    run, loader = state.run, state.loader
    log.info(f"resumed from {path} at step {run.step} (saved on {meta.get('world_size')} ranks, now {world_size})")
    lr = state.optimizer.param_groups[0]["lr"]
    position = None if loader_state_per_rank(loader) else loader_consumed_samples(loader.state_dict())
    data = "per-rank stream positions" if loader_state_per_rank(loader) else "the loader's saved position" if position is None else f"sample {position:,}"
    parts = [f"tokens seen {run.tokens_seen:,}", f"lr {float(lr):.3g}", f"data at {data}"]
    if "optimizer" in skip:
        parts.append("optimizer started fresh")
    if skip - {"optimizer"}:
        parts.append(f"not restored: {', '.join(sorted(skip - {'optimizer'}))}")
    log.info(f"restored {'; '.join(parts)}")
