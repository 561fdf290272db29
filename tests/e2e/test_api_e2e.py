"""core.api is the one module plugins import from, it documents what it exports, and plugins say
things through its logger rather than print."""

from __future__ import annotations

from conftest import REPO

EXAMPLE = REPO / "examples" / "plait-example-plugin" / "plait_example_plugin"
BUILTIN = [REPO / "plugins", REPO / "model_specs"]

# Built-in plugins that import a core internal, by (file, imported name), with the reason (none: the
# layers contract in pyproject.toml holds plugins/ and model_specs/ to core.api as well).
INTERNAL_IMPORTS: dict[tuple[str, str], str] = {}

# Files that print on purpose: the console monitor's step lines (no ``plait:`` prefix) and command-line tools.
PRINTS = {"plugins/monitors/console.py", "plugins/data/prepare.py", "plugins/data/corpus/build_shakespeare.py"}


# plait's internal packages: a plugin reaches them through core.api only.
INTERNAL_PACKAGES = ("core",)


def test_the_data_preparation_cli_starts_without_torch():
    """core.api imports the modules that need torch on first use, so plugins.data.prepare (which imports core.api) starts without it."""
    import subprocess
    import sys

    code = "import sys, plugins.data.prepare; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr
