"""What a run is made of: the core's own sections, and one section per slot.

A run's TOML has the core sections ``[train]`` and ``[monitors]`` and one
section per slot (``[model]``, ``[parallelism]``, ``[precision]``, ``[data]``,
``[optimizer]``, ``[lr_schedule]``). A slot section names its plugin with
``name`` and otherwise belongs to that plugin: its keys are the plugin's
options. The core keeps a few keys of its own in slot sections (listed in
:data:`SLOT_CORE_KEYS`). Monitors are listed in ``monitors.enabled`` and each
takes its options from ``[monitors.<name>]``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from core.checkpoint.folders import CheckpointOptions
from core.config import files as config_io
from core.config.files import subtable
from core.config.option_values import _matches, build_options, nonfinite
from core.contract.errors import ConfigError, PluginError, closest
from core.contract.options import _type_name, fields_of, key_of, option, to_dict
from core.contract.registry import Component, Registry
from core.loop.validation import ValidationOptions

# Checkpoint folders are step_<9 digits>, sorted by name; step counts and tokens must fit an int64.
MAX_STEPS = 999_999_999
MAX_TOKENS = 2**63 - 1
# The seed reaches random.seed, numpy (mod 2**32), torch.manual_seed and per-step generators
# (seed x 1_000_003 + ...), all of which a 32-bit seed keeps inside torch's 64-bit range.
MAX_SEED = 2**32 - 1
# torch.distributed keeps timeouts in int64 nanoseconds: a rendezvous asked to wait longer than
# about 9.2e9 s "timed out" at once, and past 8.6e13 s datetime.timedelta raised; about three years.
MAX_COLLECTIVE_TIMEOUT_S = 100_000_000


@dataclass
class TrainOptions:
    steps: int = option(0, "optimizer steps to run; 0 derives them from target_tokens", ge=0, le=MAX_STEPS)
    target_tokens: int = option(0, "tokens to train on when steps is 0", ge=0)
    global_batch_tokens: int = option(65536, "tokens per optimizer step, summed over all ranks", gt=0)
    micro_batch: int | Literal["auto"] = option(8, 'sequences per forward pass on each rank, or "auto": the largest that fits', gt=0)
    micro_batch_max: int = option(64, 'with micro_batch = "auto": the largest micro-batch tried (on CPU: the one used)', gt=0)
    seed: int = option(42, "seed for init, data order and dropout", ge=0, le=MAX_SEED)
    output_dir: str = option("runs/default", "folder for the resolved config, metrics and checkpoints")
    log_every: int = option(10, "steps between metric lines (the last step is always logged)", gt=0)
    grad_clip: float = option(1.0, "max global gradient norm; 0 disables clipping", ge=0)
    max_nonfinite_steps: int = option(
        3, "steps in a row with a NaN/inf loss or gradient norm that are skipped (update not applied) before the run stops with exit 3", ge=0
    )
    device: Literal["auto", "cpu", "cuda"] = option("auto", "auto: cuda when available, else cpu")
    deterministic: bool = option(False, "ask torch for deterministic kernels (slower on GPU)")
    activation_checkpointing: Literal["none", "full", "selective"] = option(
        "none", "recompute activations in the backward pass: full blocks, or all but matmul/attention outputs"
    )
    activation_checkpointing_every: int = option(1, "with 'full': checkpoint every n-th block (1 = all)", gt=0)
    compile: bool = option(False, "torch.compile each block, and the loss where the model offers it (compile_loss)")
    collective_timeout_s: int = option(
        1800,
        "seconds a collective waits for the other ranks before the run fails (a hung or stopped rank); leave room for compiles and saves",
        gt=0,
        le=MAX_COLLECTIVE_TIMEOUT_S,
    )
    stall_timeout_s: float = option(
        1800.0,
        "seconds without progress (a step's data read or compute, a monitor call, a validation batch, a save's phase or writes, a checkpoint's reads, teardown) "
        "before a rank ends the run for a restart, naming the rank furthest behind, with every thread's stack (3x until the first step ends); 0: off, else at least 1",
        ge=0,
        le=MAX_COLLECTIVE_TIMEOUT_S,
    )

    def check(self) -> None:
        if self.steps == 0 and self.target_tokens == 0:
            raise ValueError("set steps or target_tokens")
        if 0 < self.stall_timeout_s < 1:  # a run ended as 'stalled' at once, which launchers restart again and again
            raise ValueError(f"stall_timeout_s: expected 0 (off) or at least 1 second, got {self.stall_timeout_s!r}")
        if not self.output_dir.strip():  # e.g. --train.output_dir=$RUN_DIR with RUN_DIR unset: never the working directory
            raise ValueError("output_dir: expected a folder, got an empty string")
        self.output_dir = home_folder(self.output_dir)


def home_folder(folder: str) -> str:
    """``~/runs/x`` is in the home folder, as in path options (no shell expands it inside a TOML file
    or after ``--key=``); plait made a folder named ``~`` in the working directory instead."""
    return os.path.expanduser(folder) if folder.startswith("~") else folder


@dataclass
class BudgetOptions:
    force: bool = option(False, "start even when a monitor's pre-flight check (the budget guard's cost projection) refuses")


@dataclass
class MonitorsOptions:
    enabled: list[str] = option(["console", "jsonl", "mfu", "memory", "update_ratio"], "monitor plugins to run, in call order")
    on_error: Literal["stop", "continue"] = option("stop", "a monitor that raises: stop the run cleanly (with a checkpoint), or disable that monitor and go on")


# Keys of slot sections that the core reads itself; the rest go to the plugin.
SLOT_CORE_KEYS: dict[str, dict[str, tuple[Any, Any, str]]] = {
    "data": {
        "seq_len": (int, 256, "tokens per training sequence"),
    },
}
config_io.KEEP_ON_SWITCH.update({slot: tuple(keys) for slot, keys in SLOT_CORE_KEYS.items()})  # the core's, not the plugin's

# Listed by `python -m core.plugins`; read by resolve_precision_chain and core.preflight.prepare.
PRECISION_CHAIN_DOC: dict[str, tuple[str, Any, str]] = {
    "fallback": ("list[str]", [], "try these precision plugins in order, use the first supported here (options in [precision.<name>])"),
    "fallback_reasons": ("dict[str, str]", {}, "written by plait in the resolved config: why each skipped entry was unsupported"),
}

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")  # a TOML bare key: one segment of --section.key=value


def clash(slot: str, name: str, options: type) -> str | None:
    """Why component ``name`` of ``slot`` could not be configured (checked when it registers): a name
    that is not a bare TOML key, or one the core reads in the same table (a monitor named like a
    ``[monitors]`` key, a precision named like a chain key), or an option the core reads in its
    slot's section (``name``, ``data.seq_len``...), which the plugin would never receive."""
    if not BARE_KEY.fullmatch(name):
        return f"the name {name!r} is not a bare TOML key (letters, digits, '_' and '-'), so no config could name its section"
    core = {"monitor": [f.name for f in fields_of(MonitorsOptions)], "precision": list(PRECISION_CHAIN_DOC)}.get(slot, [])
    if name in core:
        return f"the name {name!r} is a key the core reads in [{SLOT_SECTIONS.get(slot, 'monitors')}]"
    taken = sorted({key_of(f) for f in fields_of(options)} & {"name", *SLOT_CORE_KEYS.get(slot, {}), *(PRECISION_CHAIN_DOC if slot == "precision" else ())})
    if slot != "monitor" and taken:
        return f"option {taken[0]!r} is a key the core reads in [{SLOT_SECTIONS[slot]}] itself (python -m core.plugins: core key), so the plugin would never receive it"
    return None


SLOT_SECTIONS: dict[str, str] = {
    "model": "model",
    "parallelism": "parallelism",
    "precision": "precision",
    "data": "data",
    "optimizer": "optimizer",
    "lr_schedule": "lr_schedule",
}

DEFAULT_PLUGIN: dict[str, str | None] = {
    "model": None,  # required
    "parallelism": "ddp",
    "precision": "fp32",
    "data": None,
    "optimizer": "adamw",
    "lr_schedule": "warmup_cosine",
}

CORE_SECTIONS = ("train", "monitors")


@dataclass
class Chosen:
    """A component picked by the config, with its filled options."""

    component: Component
    options: Any
    section: str

    def instantiate(self) -> Any:
        c = self.component
        try:
            return c.factory(self.options)
        except (ConfigError, PluginError):
            raise
        except (ValueError, TypeError, ImportError) as e:
            raise PluginError(f"[{self.section}] {c.slot} {c.name!r} from {c.provider}: {e}") from None
        except Exception as e:  # any other failure of the plugin's own code is its problem, said in one line
            raise PluginError(f"[{self.section}] {c.slot} {c.name!r} from {c.provider} failed: {type(e).__name__}: {e}") from None


@dataclass
class RunConfig:
    """A validated run: core options plus the chosen component of every slot."""

    train: TrainOptions
    monitors_options: MonitorsOptions
    core_keys: dict[str, dict[str, Any]]
    slots: dict[str, Chosen]
    monitors: list[Chosen]
    sections: dict[str, Any] = field(default_factory=dict)  # options of EXTRA_SECTIONS, by section
    precision_chain: list[Chosen] = field(default_factory=list)  # precision.fallback, in order
    precision_reasons: dict[str, str] = field(default_factory=dict)  # why earlier entries were skipped

    @property
    def seq_len(self) -> int:
        return self.core_keys["data"]["seq_len"]

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved config, every default filled in."""
        out: dict[str, Any] = {"train": to_dict(self.train)}
        for slot, chosen in self.slots.items():
            out[chosen.section] = {"name": chosen.component.name, **self.core_keys.get(slot, {}), **to_dict(chosen.options)}
        if self.precision_chain:
            out["precision"] = {
                "name": self.slots["precision"].component.name,
                "fallback": [c.component.name for c in self.precision_chain],
                "fallback_reasons": dict(self.precision_reasons),
                **{c.component.name: to_dict(c.options) for c in self.precision_chain},
            }
        out["monitors"] = {"enabled": list(self.monitors_options.enabled)}
        for m in self.monitors:
            out["monitors"][m.component.name] = to_dict(m.options)
        for section, opts in self.sections.items():
            out[section] = to_dict(opts)
        return out


# Core sections besides [train] and [monitors], by name.
EXTRA_SECTIONS: dict[str, type] = {"checkpoint": CheckpointOptions, "validation": ValidationOptions, "budget": BudgetOptions}

CORE_SECTION_OPTIONS: dict[str, type] = {"train": TrainOptions, "monitors": MonitorsOptions, **EXTRA_SECTIONS}


def resolve(cfg: dict[str, Any], registry: Registry, source: str = "config") -> RunConfig:
    """Check every key of ``cfg`` and pick a component for every slot."""
    cfg = {k: v for k, v in cfg.items() if k != "derived"}  # written by plait into config.resolved.toml for the reader
    known = set(CORE_SECTIONS) | set(SLOT_SECTIONS.values()) | set(EXTRA_SECTIONS)
    for key, value in cfg.items():
        if key not in known:
            raise ConfigError(f"{source}: unknown section [{key}]{closest(key, known)}; expected one of: {', '.join(sorted(known))}")
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a table [{key}], got {type(value).__name__}")

    train = build_options(TrainOptions, cfg.get("train", {}), f"{source}: [train]")

    slots: dict[str, Chosen] = {}
    core_keys: dict[str, dict[str, Any]] = {}
    precision_chain: list[Chosen] = []
    for slot, section in SLOT_SECTIONS.items():
        table = subtable(cfg.get(section, {}))  # keeps where each value came from (path options)
        name = table.pop("name", DEFAULT_PLUGIN[slot])
        if name is None:
            raise ConfigError(f'{source}: [{section}] needs name = "..."; installed: {", ".join(registry.names(slot))}')
        if not isinstance(name, str):
            raise ConfigError(f"{source}: [{section}].name: expected a plugin name (str), got {name!r}")
        if slot == "precision" and table.get("fallback"):
            chain = resolve_precision_chain(table, registry, f"{source}: [{section}]")
            slots[slot] = chain[0]  # core.preflight.prepare picks the first supported one
            core_keys[slot] = {}
            precision_chain = chain
            continue
        table.pop("fallback", None)
        table.pop("fallback_reasons", None)
        ck = {}
        for key, (tp, default, _doc) in SLOT_CORE_KEYS.get(slot, {}).items():
            value = table.pop(key, default)
            if tp is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"{source}: [{section}].{key}: expected a positive int, got {value!r}")
            if tp is not int and not _matches(value, tp):
                raise ConfigError(f"{source}: [{section}].{key}: expected {_type_name(tp)}, got {value!r}")
            if nonfinite(value) is not None:
                raise ConfigError(f"{source}: [{section}].{key}: expected numbers, got nan (not a number) in {value!r}")
            ck[key] = value
        core_keys[slot] = ck
        where = f"{source}: [{section}]"
        component = registry.get(slot, name, where)
        options = build_options(component.options, table, f"{where} ({slot} {name!r})")
        slots[slot] = Chosen(component, options, section)

    mon_table = dict(cfg.get("monitors", {}))
    mon_opts_tables = {k: mon_table.pop(k) for k in list(mon_table) if isinstance(mon_table[k], dict)}
    monitors_options = build_options(MonitorsOptions, mon_table, f"{source}: [monitors]")
    twice = sorted({n for n in monitors_options.enabled if monitors_options.enabled.count(n) > 1})
    if twice:
        raise ConfigError(f"{source}: [monitors].enabled lists {twice[0]!r} twice; expected each monitor once")
    monitors = []
    for name in monitors_options.enabled:
        component = registry.get("monitor", name, f"{source}: monitors.enabled")
        options = build_options(component.options, mon_opts_tables.pop(name, {}), f"{source}: [monitors.{name}]")
        monitors.append(Chosen(component, options, f"monitors.{name}"))
    if mon_opts_tables:
        extra = sorted(mon_opts_tables)
        raise ConfigError(f"{source}: [monitors.{extra[0]}] configures a monitor that is not in monitors.enabled = {monitors_options.enabled}")

    sections = {section: build_options(cls, cfg.get(section, {}), f"{source}: [{section}]") for section, cls in EXTRA_SECTIONS.items()}
    return RunConfig(train, monitors_options, core_keys, slots, monitors, sections, precision_chain)


def resolve_precision_chain(table: dict[str, Any], registry: Registry, where: str) -> list[Chosen]:
    """``fallback = ["mxfp8", "fp8", "bf16"]``; each entry's options come from ``[precision.<name>]``."""
    chain = table.pop("fallback")
    table.pop("fallback_reasons", None)
    table.pop("name", None)  # the chain decides; a resolved config records the choice here
    if not (isinstance(chain, list) and chain and all(isinstance(n, str) for n in chain)):
        raise ConfigError(f"{where}.fallback: expected a non-empty list of precision plugin names, got {chain!r}")
    out = []
    for name in chain:
        component = registry.get("precision", name, f"{where}.fallback")
        sub = table.pop(name, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"{where}.{name}: expected a table of {name!r} options, got {sub!r}")
        out.append(Chosen(component, build_options(component.options, sub, f"{where}.{name}"), "precision"))
    if table:
        key = sorted(table)[0]
        raise ConfigError(f"{where}: unknown key {key!r}; with a fallback chain, put each plugin's options in [precision.<name>]")
    return out


def batch_layout(global_batch_tokens: int, micro_batch: int, seq_len: int, world_size: int) -> int:
    """Accumulation steps so that micro_batch x seq_len x world_size x accum == global_batch_tokens."""
    per_pass = micro_batch * seq_len * world_size
    if global_batch_tokens % per_pass != 0:
        raise ConfigError(
            f"train.global_batch_tokens = {global_batch_tokens} is not divisible by "
            f"train.micro_batch ({micro_batch}) x data.seq_len ({seq_len}) x world size ({world_size}) = {per_pass}; "
            f"try global_batch_tokens = {max(1, round(global_batch_tokens / per_pass)) * per_pass}"
        )
    return global_batch_tokens // per_pass


def total_steps(train: TrainOptions, tokens_per_step: int) -> int:
    steps = train.steps or -(-train.target_tokens // tokens_per_step)
    if steps > MAX_STEPS:
        raise ConfigError(
            f"[train].target_tokens = {train.target_tokens} needs {steps} steps of {tokens_per_step} tokens; "
            f"expected at most {MAX_STEPS} steps (checkpoint folders count steps in 9 digits)"
        )
    if steps * tokens_per_step > MAX_TOKENS:
        raise ConfigError(f"[train] {steps} steps x {tokens_per_step} tokens overflow the 64-bit token counter; expected at most {MAX_TOKENS} tokens")
    return steps
