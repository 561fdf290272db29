"""The package layout in separate processes: importing every library module in a fresh interpreter loads
no command module, and ``lint-imports`` finds imports running one way as the import contracts say."""

from __future__ import annotations

import re
import subprocess

from conftest import PY, REPO, env

CORE = REPO / "core"
# python -m core.<name> for each command: it lives in core/cli/<name>.py
SHIMS = ("train", "plan", "plugins", "export", "report", "generate", "eval")


def test_importing_every_library_module_loads_no_tools():
    code = (
        f"import importlib, sys\nSHIMS = {SHIMS!r}\n"
        "from pathlib import Path\n"
        "for path in sorted(Path('core').rglob('*.py')):\n"
        "    name = '.'.join(path.with_suffix('').parts).removesuffix('.__init__')\n"
        "    if not name.startswith('core.cli') and name.rsplit('.', 1)[-1] not in SHIMS:\n"
        "        importlib.import_module(name)\n"
        "print(sorted(k for k in sys.modules if k == 'core.cli' or k.startswith('core.cli.')))\n"
    )
    proc = subprocess.run([PY, "-c", code], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_imports_run_one_way_as_the_import_contracts_say():
    """``lint-imports`` (import-linter, pyproject.toml's [tool.importlinter]): core's packages import only
    the layers below them, plugins/ and model_specs/ import core.api alone, and no two packages
    import each other."""
    import sys
    from pathlib import Path

    lint = Path(sys.executable).parent / "lint-imports"
    assert lint.is_file(), f"{lint}: import-linter is in the dev extra (pip install -e '.[dev]')"
    proc = subprocess.run([str(lint), "--no-cache"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"Contracts: 4 kept, 0 broken\.", proc.stdout), proc.stdout[-2000:]
