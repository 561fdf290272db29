"""µP (the maximal update parametrization, Yang et al. 2022): the learning rate of each parameter kind.

A model asks for µP with ``[model] parametrization = "mup"`` and declares its widths with the spec's
optional ``mup_widths()``: ``(width, base_width)``, its hidden width and the width its
hyperparameters were tuned at (None under standard parametrization). The model applies the
forward and init side itself (the output logits times ``base_width / width``, attention scores
1/d, an untied head's init constant in width). The core applies the optimizer side from the kinds
of :mod:`core.contract.param_groups`, with ``r = base_width / width``:

* ``matrix`` (hidden weights): LR x ``r ** p``, where ``p`` is the optimizer's optional
  ``mup_matrix_lr_power``: 1 for updates normalized entry by entry (AdamW, default), 0 for
  Muon's spectral rule (its shape adjustment already makes the update width-independent in the
  spectral norm), 0.5 for Muon's ``match_rms_adamw``;
* ``embedding``, ``norm``, ``bias``, ``output`` (vector-like, and the head whose logits carry the
  ``r`` multiplier): LR x 1.

The untied head always gets its own group (``output``) under µP, whatever the optimizer's
``separate_output_head``. A tied head is the embedding: embedding LR and init, logits times ``r``.
At its base width (``r = 1``) a µP run is the standard run.
"""

from __future__ import annotations

from typing import Any

from core.contract.errors import ConfigError, PluginError
from core.contract.members import member
from core.contract.param_groups import KINDS, OUTPUT

PARAMETRIZATIONS = ("standard", "mup")


def model_widths(spec: Any, name: str) -> tuple[int, int] | None:
    """The spec's ``mup_widths()`` answer, held to ``(width, base_width)`` ints with base_width a
    divisor of width, or None (standard parametrization, or no such member)."""
    fn = member("model", spec, "mup_widths")
    widths = None if fn is None else fn()
    if widths is None:
        return None
    if not (isinstance(widths, tuple) and len(widths) == 2 and all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths)):
        raise PluginError(f"model plugin {name!r}: mup_widths() returned {widths!r}; expected (width, base_width), two ints > 0, or None")
    width, base = widths
    if width % base:
        raise PluginError(f"model plugin {name!r}: mup_widths() returned base width {base}, not a divisor of width {width}")
    return width, base


def check_asked(spec: Any, name: str, section: dict[str, Any], where: str) -> tuple[int, int] | None:
    """The model's widths; ConfigError (one line) when ``[model].parametrization = "mup"`` is asked
    of a model that declares none."""
    widths = model_widths(spec, name)
    if section.get("parametrization") == "mup" and widths is None:
        raise ConfigError(
            f'{where}: [model].parametrization = "mup" but model {name!r} declares no widths (its spec\'s mup_widths() is absent or None); '
            'expected a model that declares (width, base_width), or parametrization = "standard"'
        )
    return widths


def unasked_option(table: dict[str, Any], options: type, name: str, where: str) -> None:
    """``parametrization`` in a model's section when its options have no such key: one line saying
    the model does not declare µP (rather than an unknown key)."""
    known = getattr(options, "__dataclass_fields__", {})
    if "parametrization" in table and "parametrization" not in known:
        raise ConfigError(
            f"{where}.parametrization: model {name!r} has no parametrization option and declares no widths (mup_widths()); "
            "expected a model that supports µP, or no parametrization key"
        )


def lr_multipliers(widths: tuple[int, int] | None, optimizer: Any) -> dict[str, float]:
    """µP's LR multiplier per kind (all 1.0 under standard parametrization, ``widths`` None)."""
    out = {kind: 1.0 for kind in (*KINDS, OUTPUT)}
    if widths is not None:
        width, base = widths
        power = float(member("optimizer", optimizer, "mup_matrix_lr_power"))
        out["matrix"] = (base / width) ** power
    return out
