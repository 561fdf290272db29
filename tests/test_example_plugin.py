"""The example third-party distribution installs, is discovered, and trains from a TOML that names it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, read_metrics, run_module


@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(REPO / "examples" / "plait-example-plugin")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return {"PYTHONPATH": str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_listed_with_its_distribution(example_site):
    proc = run_module("core.plugins", extra_env=example_site)
    assert proc.returncode == 0, proc.stderr
    assert "lion" in proc.stdout and "[from plait-example-plugin, plugin 'example']" in proc.stdout
    assert "loss_target" in proc.stdout and "stop once the logged training loss is below this value" in proc.stdout


def test_trains_with_third_party_optimizer_and_monitor(example_site, tiny_config, tmp_path):
    cfg = tiny_config(steps=40, body=(
        "[optimizer]\nname = \"lion\"\nlr = 2e-3\n"
        "[monitors.loss_target]\ntarget = 3.6\n"
    ))
    proc = run_module("core.train", "--config", str(cfg), '--monitors.enabled=["console", "jsonl", "loss_target"]',
                      extra_env=example_site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "out")
    assert rows[-1]["loss"] < 3.6 and rows[-1]["step"] < 40  # the monitor stopped the run early
    assert "loss_target" not in proc.stderr
    assert "checkpoint committed" in proc.stdout and "(requested)" in proc.stdout


def test_allow_list_hides_third_party(example_site, tiny_config):
    proc = run_module("core.train", "--config", str(tiny_config()), "--optimizer.name=lion",
                      extra_env={**example_site, "PLAIT_PLUGINS": ""})
    assert proc.returncode == 2 and "no optimizer plugin named 'lion'" in proc.stderr
