"""Errors that end a run before any expensive work, with exit code 2."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import time
from typing import Iterable, NoReturn

from core.contract import log

EXIT_BAD_INPUT = 2


class PlaitError(Exception):
    """Bad input: a config, data file, checkpoint or plugin that cannot be used.

    The message is one line that names the file, key or plugin and says what
    was expected. ``core.train`` prints it and exits with code 2.
    """


class ConfigError(PlaitError):
    """A configuration file, key or value is wrong."""


class PluginError(PlaitError):
    """A plugin failed to load, or two plugins claim the same name."""


class DataError(PlaitError):
    """A data file is missing, empty or inconsistent with the model."""


class CheckpointError(PlaitError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


def closest(name: str, choices: Iterable[str]) -> str:
    """A ``did you mean`` suffix for an unknown name, or an empty string."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def tell_torchrun(message: str, callstack: str | None = None) -> None:
    """Why this process failed, in the error file torchrun reads (``TORCHELASTIC_ERROR_FILE``), so
    that its failure summary names the reason instead of "To enable traceback see: ...". Best effort."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        data = {"message": {"message": message, "extraInfo": {"py_callstack": callstack or message, "timestamp": str(int(time.time()))}}}
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            pass


def exit_bad_input(err: PlaitError) -> NoReturn:
    """Print ``err`` as plait's one line (``plait: error: ...``, also to torchrun's error file) and exit with code 2."""
    log.error(str(err), all_ranks=True)  # every rank that met it: one line each, never split by another's
    tell_torchrun(f"plait: error: {err}")
    raise SystemExit(EXIT_BAD_INPUT)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for plait's commands: no abbreviations (``--c`` is not ``--config``, ``--=5`` is an
    override that fails as one), and a command-line mistake is plait's one line with exit code 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        exit_bad_input(ConfigError(f"command line: {message} (see {self.prog} --help)"))
