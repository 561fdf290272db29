"""A checkpoint's weights and this run's model: the options that define the function they compute.

:func:`core.checkpoint.folders.check_shapes` refuses a checkpoint whose tensors do not fit the
model. Some options change the function without changing a shape (llama3's ``n_heads`` with
``n_kv_heads``, ``tie_embeddings``, ``norm_eps``; recurrent_moe's ``n_loops`` and ``top_k``): such
weights load, and the run trains another function from them. A model spec names those options in
its optional ``architecture_options`` (``core/contract/members.py``); others (``rope_theta``,
``max_seq_len``: a context extension) may change on purpose and are left out.

A resume, and ``checkpoint.initial_load`` of a plait checkpoint, compares the model's name and
the declared options with the resolved config saved in the checkpoint's ``state.json`` (a small
file, read before any model is built), once the shapes fit (:func:`core.checkpoint.folders.check_fits`,
whose line names the tensors of a changed ``dim``); a difference is bad input (exit code 2), one line naming
the checkpoint and each option with its saved and its new value.

A spec that also declares ``resolved_architecture()`` (``{name: value}`` as built: ``n_heads = 0``
resolved to the flavor's value) has those values saved in each checkpoint's ``state.json``
(``architecture``) and compared, so ``n_heads = 0`` and the flavor's own value written out are the
same architecture. A checkpoint that recorded none (saved by a spec without it, or by a plait without the record) is
compared as written in the resolved config. A value the saved side lacks (added to the plugin since)
is not compared. A spec that declares no ``architecture_options`` has its checkpoints checked by
shape only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.contract.errors import ConfigError, PluginError
from core.contract.members import member

STATE_FILE = "state.json"  # core.checkpoint.folders.STATE_FILE (which imports this module)
RESOLVED = "(resolved)"  # the key of the resolved values: no option's name (an identifier) is it


def _plain(value: Any) -> Any:
    """As the value reads back from a checkpoint's state.json (tuples are lists there)."""
    return json.loads(json.dumps(value))


def run_architecture(spec: Any, name: str, section: dict[str, Any]) -> dict[str, Any] | None:
    """This run's model name and the values of its spec's ``architecture_options`` in ``section``
    (the resolved config's ``[model]``); None when the spec declares none. A declaration that is not
    a tuple of the names of its options is the plugin's error (PluginError)."""
    names = member("model", spec, "architecture_options")
    if names is None:
        return None
    where = f"model plugin {name!r}: architecture_options"
    if not isinstance(names, tuple) or not all(isinstance(n, str) for n in names):
        raise PluginError(f"{where} must be a tuple of option names, got {names!r}")
    options = [k for k in section if k != "name"]
    unknown = [n for n in names if n not in options]
    if unknown:
        raise PluginError(f"{where} names {unknown[0]!r}, which is not one of its [model] options ({', '.join(options)})")
    architecture = {"name": name, **{n: _plain(section[n]) for n in names}}
    resolved = member("model", spec, "resolved_architecture")
    if resolved is not None:
        architecture[RESOLVED] = _resolved(resolved(), f"model plugin {name!r}: resolved_architecture()")
    return architecture


def _resolved(values: Any, where: str) -> dict[str, Any]:
    """The spec's ``resolved_architecture()`` answer, held to ``{name: JSON value}``."""
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        raise PluginError(f"{where} returned {type(values).__name__}; expected {{name: value}} with string names")
    try:
        return _plain(values)
    except (TypeError, ValueError) as e:
        raise PluginError(f"{where} returned a value that is not JSON ({e}); expected numbers, strings, booleans or lists") from None


def differences(saved: dict[str, Any], expected: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(option, saved value, this run's)`` for each declared option that differs; another model
    name is the one difference (the options are another plugin's)."""
    if saved.get("name") != expected["name"]:
        return [("name", saved.get("name"), expected["name"])]
    old, new = saved.get(RESOLVED), expected.get(RESOLVED)
    if isinstance(old, dict) and new is not None:  # both resolved: the values the weights were built with
        return [(k, old[k], v) for k, v in new.items() if k in old and _plain(old[k]) != v]
    return [(k, saved[k], v) for k, v in expected.items() if k not in ("name", RESOLVED) and k in saved and _plain(saved[k]) != v]


def saved_model_section(path: Path) -> dict[str, Any] | None:
    """The ``[model]`` section of the config saved in checkpoint ``path``, with the resolved values its
    ``state.json`` recorded (``architecture``, key :data:`RESOLVED`) if any; None when it cannot be
    read (:func:`core.checkpoint.folders.verify` says what is wrong with such a checkpoint)."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        section = state["config"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(section, dict):
        return None
    recorded = state.get("architecture")
    if isinstance(recorded, dict) and recorded.get("name") == section.get("name") and isinstance(recorded.get(RESOLVED), dict):
        return {**section, RESOLVED: recorded[RESOLVED]}
    return section


def check_architecture(path: Path, expected: dict[str, Any] | None, explicit: bool, initial_load: bool = False) -> None:
    """Refuse checkpoint ``path`` (ConfigError, one line) when its model differs from ``expected``
    (:func:`run_architecture`) in name or a declared option. ``explicit``: named by
    ``checkpoint.resume``; ``initial_load``: the weights a fresh run starts from."""
    saved = saved_model_section(path) if expected is not None else None
    if saved is None or expected is None:
        return
    diff = differences(saved, expected)
    if not diff:
        return
    changes = ", ".join(f"model.{k} {old!r} -> {new!r}" for k, old, new in diff)
    them = "them" if len(diff) > 1 else "it"
    if initial_load:
        what, fix = f"checkpoint.initial_load {path}", f"change {them} back to start from its weights, or leave checkpoint.initial_load out"
    else:
        fresh = "a fresh run folder (another train.output_dir" + (", checkpoint.resume left out)" if explicit else ")")
        what, fix = f"checkpoint {path}", f"change {them} back to resume from it, or train the new architecture from scratch in {fresh}"
    raise ConfigError(f"{what} was saved with another model architecture: {changes}; its weights would compute another function in this model: {fix}")
