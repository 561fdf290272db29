"""The run's plugins asked, before anything is built, what the core will ask them later.

Each call goes through :func:`call_plugin`, so a plugin's own exception is one line naming the
plugin and the member (exit code 2), and each answer is held to the shape ``core/contract/protocols.py``
and ``core/contract/members.py`` declare, so a wrong one is refused now rather than as a traceback in
``core.plan``, or mid-run. plait's own errors (``ConfigError``, ``DataError``...) pass as they are.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from core.contract.errors import ConfigError, PlaitError, PluginError
from core.contract.members import member
from core.contract.protocols import LoaderSpec, data_fingerprint, data_has_split, data_parts, data_samples_before_loader, data_tokens_per_epoch
from core.data.indexed import IndexedSource, checked_sample


def call_plugin(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a plugin's code: plait's own errors pass (one line, exit 2), anything
    else becomes a PluginError that names ``what`` (the plugin and its method)."""
    try:
        return fn(*args, **kwargs)
    except PlaitError:
        raise
    except Exception as e:
        raise PluginError(f"{what} failed: {type(e).__name__}: {e}") from None


def build_meta(spec: Any, name: str) -> nn.Module:
    """The model spec's ``build()`` on the meta device, held to returning an ``nn.Module``."""
    with torch.device("meta"):
        model = call_plugin(f"model {name!r}: build", spec.build)
    if not isinstance(model, nn.Module):
        raise PluginError(f"model {name!r}: build() returned {type(model).__name__}; expected a torch.nn.Module")
    return model


def check_unchanged(what: str, fn: Any, model: nn.Module) -> None:
    """``fn(model)`` through :func:`call_plugin`, for a check that only reads the meta model the later
    checks share: one that changed a parameter's name, shape or dtype is refused."""
    before = [(n, p.shape, p.dtype) for n, p in model.named_parameters()]
    call_plugin(what, fn, model)
    if [(n, p.shape, p.dtype) for n, p in model.named_parameters()] != before:
        raise PluginError(f"{what} changed the model it was given; a check only reads it")


def _number(value: Any, lowest: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= lowest


def check_model_answers(spec: Any, name: str, micro_batch: int, seq_len: int) -> None:
    """The spec's cheap answers that ``core.plan`` and the ``mfu`` monitor use: finite numbers."""
    flops = call_plugin(f"model {name!r}: flops_per_token", spec.flops_per_token, seq_len)
    if not _number(flops, 0) or flops == 0:
        raise PluginError(f"model {name!r}: flops_per_token({seq_len}) returned {flops!r}; expected a finite number > 0")
    act = call_plugin(f"model {name!r}: activation_bytes", spec.activation_bytes, micro_batch, seq_len, 4)
    if not _number(act, 0):
        raise PluginError(f"model {name!r}: activation_bytes({micro_batch}, {seq_len}, 4) returned {act!r}; expected a finite number >= 0")


def check_data(data: Any, name: str, vocab_size: int, seq_len: int, val_every: int, val_split: str, path: str) -> None:
    """Validate the data source and ask what the run will: its first sample (an IndexedSource whose
    samples answer before a loader exists), its size and fingerprint, and its validation split."""
    where = f"data {name!r}"
    call_plugin(f"{where}: validate", data.validate, vocab_size, seq_len)
    if isinstance(data, IndexedSource) and data_samples_before_loader(data):  # the first sample's shape and ids, now
        call_plugin(f"{where}: sample", checked_sample, data, 0, seq_len, "train", vocab_size, name)
    call_plugin(f"{where}: tokens_per_epoch", data_tokens_per_epoch, data, where)  # cheap answers the run asks again
    call_plugin(f"{where}: fingerprint", data_fingerprint, data)
    if not val_every or call_plugin(f"{where}: has_split", data_has_split, data, val_split, where):
        return
    parts = call_plugin(f"{where}: parts", data_parts, data, where)  # a mixture: name the sources without the split
    lacking = [
        label
        for label, source in parts.items()
        if not call_plugin(f"{where}: source {label!r}: has_split", data_has_split, source, val_split, f"{where}: source {label!r}")
    ]
    which = f" (source{'s' * (len(lacking) > 1)} {', '.join(map(repr, lacking))} of the mixture: no {val_split!r} split)" if lacking else ""
    raise ConfigError(f"{path}: validation.every = {val_every} but the data source has no {val_split!r} split{which}")


def check_first_step(data: Any, name: str, spec: LoaderSpec) -> None:
    """The data source's optional ``check_first_step``: data too small for one step (a source that
    stops the run when it runs out would end it at step 0, exit code 0) is bad input now."""
    check = member("data", data, "check_first_step")
    if check is not None:
        call_plugin(f"data {name!r}: check_first_step", check, spec)
