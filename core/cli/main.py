"""``plait <command> [flags]``: one entry point for plait's commands (``[project.scripts]`` in pyproject.toml).

``plait <command> ...`` takes the same flags as ``python -m core.<command> ...`` and exits with the
same codes; ``plait train`` also starts several ranks (``--nproc N``: :mod:`core.cli.launch`).
``plait --help`` lists the commands. A command joins with one line in :data:`COMMANDS`: its name,
the module whose ``main(argv) -> int`` runs it, and a one-line summary.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple

from core.contract.errors import ConfigError, exit_bad_input


class Command(NamedTuple):
    module: str  # its main(argv: list[str] | None) -> int runs the command
    summary: str
    extra: str = ""  # the optional extra (pyproject.toml) whose libraries the module imports, if any


COMMANDS: dict[str, Command] = {
    "train": Command("core.cli.launch", "train on one process, or on N (--nproc N) through torch's elastic launcher"),
    "plan": Command("core.cli.plan", "dry run: plugins and options, parameters, FLOPs, batch layout, memory, ETA, problems found"),
    "plugins": Command("core.cli.plugins", "every slot, its installed plugins and their options"),
    "export": Command("core.cli.export", "a checkpoint's weights as safetensors or in Hugging Face's layout"),
    "generate": Command("core.cli.generate", "sample text from a checkpoint or an export"),
    "mup-check": Command("core.cli.mup_check", "µP's coordinate check: RMS of each layer's activations and updates against width, standard vs µP"),
    "report": Command("core.cli.report", "a run's manifest, metrics CSV, curves and final weights"),
    "eval": Command("core.cli.eval", "score a checkpoint or an export on task and held-out files: a table and JSON"),
    "lm-eval": Command("core.cli.lm_eval_model", "lm-evaluation-harness's command line with the model plait registered", extra="eval"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    return "\n".join(
        [
            "usage: plait <command> [flags]",
            "",
            "plait's commands; `plait <command> --help` lists a command's flags (the same as `python -m core.<command>`'s).",
            "",
            "commands:",
            *rows,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    command = COMMANDS.get(name)
    if command is None:
        from core.contract.errors import closest

        exit_bad_input(
            ConfigError(f"command line: unknown command {name!r}{closest(name, COMMANDS)}; expected one of {', '.join(COMMANDS)} (see plait --help)")
        )
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as e:
        if not command.extra or (e.name or "").startswith(("core", "plugins", "model_specs")):
            raise
        exit_bad_input(
            ConfigError(
                f"plait {name}: needs {(e.name or '?').split('.')[0]}, which is in the optional extra {command.extra!r}: pip install -e '.[{command.extra}]'"
            )
        )
    return module.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
