"""core.api imports what needs torch on first use: plugins.data.prepare, which imports core.api, starts without torch."""

from __future__ import annotations

from conftest import REPO


def test_the_data_preparation_cli_starts_without_torch():
    """core.api imports the modules that need torch on first use, so plugins.data.prepare (which imports core.api) starts without it."""
    import subprocess
    import sys

    code = "import sys, plugins.data.prepare; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr
