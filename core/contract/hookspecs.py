"""plait's plugin API: every hook a plugin can implement, and the check that holds a monitor to them.

The docstrings in this module are the reference. A plugin is a Python module
(or object) named by an entry point in the group ``plait``::

    [project.entry-points.plait]
    my_plugin = "my_package.plait_plugin"

and implements hooks with :data:`hookimpl`::

    from core.api import hookimpl

    @hookimpl
    def plait_register(registry):
        registry.add("monitor", "my_monitor", MyMonitor, options=MyOptions,
                     doc="what it does, in one line")

plait's own built-in plugins are registered through the same entry points
(see ``pyproject.toml``); there is no other way in.

Two kinds of hooks exist:

* **Discovery** (``plait_register``) is called once per process on every
  installed plugin module.
* **Run events** (``plait_train_start`` ... ``plait_train_end``) are called on
  the *monitor objects* that the run's config enables, in the order the
  config lists them. Monitors are pluggy plugins too: any object whose methods
  carry ``@hookimpl`` and match the names below.
"""

from __future__ import annotations

import difflib
import inspect
from typing import TYPE_CHECKING, Any

import pluggy

from core.contract.errors import PluginError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from core.contract.run import PreparedRun, Run

PROJECT = "plait"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def plait_register(registry: Any) -> None:
    """Register this plugin's components on ``registry``, a :class:`core.api.Registry`.

    Call ``registry.add(slot, name, factory, options=OptionsDataclass, doc=...)``
    once per component. ``slot`` is one of :data:`core.contract.protocols.SLOTS`.
    ``factory(options)`` is called with an instance of ``OptionsDataclass``
    filled from the component's TOML section, and must return an object that
    satisfies the slot's protocol in :mod:`core.contract.protocols`. Each dataclass
    field is one option; give it a one-line doc with
    :func:`core.contract.options.option`.

    A name already claimed in the same slot by another plugin is an error
    that names both providers.
    """


@hookspec
def plait_train_start(run: "Run") -> None:
    """The model, optimizer and data are built and the first step is next.

    ``run.step`` is the step training starts from (non-zero after a resume),
    ``run.total_steps`` the step it ends at, ``run.config`` the resolved
    config as a dict, ``run.output_dir`` the run's folder, ``run.dist`` this
    process's :class:`core.contract.protocols.DistInfo`. Called on every rank; use
    ``run.dist.is_main`` to write files once.
    """


@hookspec
def plait_step_end(run: "Run", step: int, metrics: dict[str, Any]) -> None:
    """An optimizer step finished; ``step`` counts completed steps (1-based).

    ``metrics`` is filled on log steps only (``train.log_every``) and holds at
    least ``loss`` (averaged over every token of the step on all ranks),
    ``grad_norm``, ``lr``, ``tokens_seen``, ``tokens_per_s``, ``step_time_s``,
    ``elapsed_s`` and ``eta_s``, then what monitors added through
    :func:`plait_metrics`; on other steps it is empty, so that a hook
    that only needs the step number costs nothing. Call
    ``run.request_stop(reason, checkpoint=True|False)`` to end the run at
    this step boundary; every rank follows the request of any rank.
    """


@hookspec
def plait_metrics(run: "Run", step: int, metrics: dict[str, Any]) -> dict[str, Any] | None:
    """A log step: return more metrics for it, or None.

    Called on log steps only, before :func:`plait_step_end`, on every rank. Issue no collective
    of your own (one rank failing before it leaves the others waiting until the timeout): return
    ``core.api.Reduced(op, value)`` and the core reduces it over the ranks once every monitor ran.
    ``metrics`` holds what the core measured (see :func:`plait_step_end`)
    and what the monitors listed earlier returned; do not change it. The
    dicts returned are merged into it in monitor order, and every monitor's
    ``plait_step_end`` then receives the whole. The ``mfu``, ``memory`` and
    ``update_ratio`` monitors are built this way.
    """


@hookspec
def plait_replace_batch(run: "Run", step: int, micro: int, inputs: "torch.Tensor", labels: "torch.Tensor") -> "tuple[torch.Tensor, torch.Tensor] | None":
    """Micro-batch ``micro`` (0-based) of step ``step`` (1-based) is about to enter the model.

    Return ``(inputs, labels)`` to train on instead, tensors of the same
    shapes (integer token ids below the model's vocabulary size), or None to
    keep the batch. The first monitor (in config order) to return a pair
    wins. The real batch is consumed either way: the data position moves on.
    This is for rehearsals and tests of what bad data does
    (``spike_rehearsal``); it is called only while a monitor implements it.
    """


@hookspec
def plait_preflight(prep: "PreparedRun", force: bool) -> None:
    """The run is planned and checked; no process group or model exists yet (``core.train`` on
    every rank, and ``core.plan``). ``prep`` is a :class:`core.api.PreparedRun` (its fields:
    ``help(core.api.PreparedRun)``). ``force`` is ``budget.force``. Raise
    :class:`core.contract.errors.ConfigError` to refuse the run in one line (exit 2); anything else is
    reported as the monitor's failure, also exit 2. The ``budget_guard`` refuses a run whose projected
    cost is over its cap this way.
    """


@hookspec(firstresult=True)
def plait_seq_len_schedule(seq_len: int, total_steps: int) -> list[tuple[int, int]] | None:
    """The sequence lengths of the run: asked once, before the run starts (and by ``core.plan``).

    Return ``[(first_step, seq_len), ...]`` with ``first_step`` rising: once
    ``first_step`` steps are complete (0-based; ``0`` is the first step), the
    batches are ``seq_len`` tokens long; before the first entry they are
    ``data.seq_len`` long (the ``seq_len`` argument). Tokens per micro-batch stay
    ``train.micro_batch x data.seq_len``, so every ``seq_len`` must divide that
    number; the core checks this and the model's ``max_seq_len`` and refuses
    the run with one line (exit 2) otherwise, and switches the loader to the
    new shape at the same data position. ``total_steps`` is the run's length.
    The first monitor (in config order) to return a list wins; None keeps
    ``data.seq_len`` throughout. The ``seq_len_stages`` monitor is built this way.
    """


@hookspec
def plait_planned_evaluation() -> dict[str, Any] | None:
    """What this monitor evaluates during training, for ``core.plan``'s estimate of its cost: asked
    by ``core.plan`` after ``plait_preflight``, never during a run.

    Return ``{"every": N, "cost": PassCost | None, "why": "..."}`` or None: a pass every ``N``
    steps and at the final step; ``cost`` one pass's forwards over all ranks
    (:class:`core.api.evaluation.PassCost`, from ``Evaluation.pass_cost``), None when they are
    unknown (its files are not readable here), ``why`` then saying what is missing. The plan
    counts each forward token at a third of the model's training FLOPs per token at that
    forward's width. The ``downstream`` monitor answers this way.
    """


@hookspec
def plait_before_update(run: "Run", step: int, loss: float, grad_norm: float, clip_coef: float) -> str | None:
    """Gradients of step ``step`` (1-based) are ready and already clipped; the optimizer has not stepped yet.

    ``loss`` is the step's loss averaged over all ranks and ``grad_norm`` the
    global gradient norm *before* clipping, as floats. The gradients (``p.grad``)
    are already clipped to ``train.grad_clip``: multiplied by ``clip_coef`` =
    ``min(1, grad_clip / (grad_norm + 1e-6))`` (1.0 when ``grad_clip = 0`` or the
    norm is below it; NaN when the norm is), so a gradient's norm before clipping
    is its norm now divided by ``clip_coef``. A parameter's or gradient's share of
    a norm over the ranks: :func:`core.api.squared_norm_share`. Implementing this
    hook costs two small all-reduces and a device sync per step, so only monitors
    that must act before the update (spike handling) should. Return ``"skip"`` to
    drop this update (gradients are discarded; the step still counts),
    ``"rollback"`` to restore the last complete checkpoint while keeping the data
    position (so the batches since then, the offending ones included, are
    skipped), or None. Every rank follows the strongest verdict of any rank's
    monitors (rollback, then skip), so one that decides, or fails, on one rank
    never splits the replicas. A rollback restores all the checkpoint holds, the
    ``run.state`` keys it saved included (keep what must outlive a rollback on
    the monitor object), but the data position and the wall time.
    """


@hookspec
def plait_validation_end(run: "Run", step: int, metrics: dict[str, Any]) -> None:
    """A validation pass finished; ``metrics`` holds ``val_loss`` at least."""


@hookspec
def plait_checkpoint_saved(run: "Run", step: int, path: str) -> None:
    """A checkpoint for ``step`` is complete on every rank and committed at ``path``."""


@hookspec
def plait_train_end(run: "Run", reason: str) -> None:
    """Training stopped; called once on every rank, also when the run fails.

    ``reason`` is one of:

    * ``"completed"``: the last step is done;
    * ``"data_end"``: the data source ran out (``on_exhausted``/``on_end = "stop"``);
    * ``"signal"``: SIGTERM, SIGINT or SIGHUP (a checkpoint was saved first, unless a
      second Ctrl-C stopped the run at once);
    * ``"requested"``: ``run.request_stop`` was called (by a monitor;
      ``run.stop`` says why);
    * ``"diverged"``: more than ``train.max_nonfinite_steps`` steps in a row
      had a non-finite loss or gradient norm, or the state to save held NaN
      or inf; no checkpoint is written, exit code 3;
    * ``"save_failed"``: a checkpoint could not be written (disk full, I/O
      error): every rank stops without a checkpoint, exit code 74;
    * ``"error"``: an exception ended the run (plait's one-line errors found
      mid-run too, exit 2); the process still exits with its error after this
      hook returns. A monitor that raises here is named; the exit code stands.
    """


RUN_EVENT_HOOKS: tuple[str, ...] = (
    "plait_preflight",
    "plait_train_start",
    "plait_replace_batch",
    "plait_seq_len_schedule",
    "plait_planned_evaluation",
    "plait_before_update",
    "plait_metrics",
    "plait_step_end",
    "plait_validation_end",
    "plait_checkpoint_saved",
    "plait_train_end",
)


def register_monitor(pm: pluggy.PluginManager, name: str, obj: Any) -> None:
    """Register monitor ``obj`` as ``name`` on ``pm``, or raise PluginError naming what is wrong."""
    marker = PROJECT + "_impl"  # set by core.contract.hookspecs.hookimpl
    for attr in dir(type(obj)):
        if not attr.startswith("plait_"):
            continue
        method = getattr(obj, attr, None)
        if not callable(method):
            continue
        opts = getattr(method, marker, None)
        if attr not in RUN_EVENT_HOOKS:
            close = difflib.get_close_matches(attr, RUN_EVENT_HOOKS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PluginError(f"monitor {name!r}: {attr!r} is not a run-event hook{hint}; the hooks are {', '.join(RUN_EVENT_HOOKS)}")
        if opts is None:
            raise PluginError(f"monitor {name!r}: {attr} lacks @hookimpl (from core.contract.hookspecs import hookimpl), so it would never be called")
        if opts.get("wrapper") or opts.get("hookwrapper"):
            raise PluginError(f"monitor {name!r}: {attr} is a wrapper hook; run-event hooks are plain calls")
        spec_args = set(inspect.signature(globals()[attr]).parameters)
        args = [a for a in inspect.signature(method).parameters]
        unknown = [a for a in args if a not in spec_args]
        if unknown:
            raise PluginError(f"monitor {name!r}: {attr}({', '.join(args)}) asks for {unknown[0]!r}; the hook passes {', '.join(sorted(spec_args))}")
    try:
        pm.register(obj, name=name)
    except (pluggy.PluginValidationError, ValueError) as e:
        raise PluginError(f"monitor {name!r}: {e}") from None
