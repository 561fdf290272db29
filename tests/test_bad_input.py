"""Every kind of bad input exits with code 2 and one clear line, before any process group or model."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import REPO, run_module


def train(*args):
    return run_module("core.train", *args, timeout=60)


def one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("plait: error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    return lines[0]


def test_missing_config_file(tmp_path):
    assert "config file" in one_error_line(train("--config", str(tmp_path / "nope.toml")))


def test_unknown_key_with_suggestion(tiny_config):
    msg = one_error_line(train("--config", str(tiny_config()), "--optimizer.lrr=1e-3"))
    assert "[optimizer]" in msg and "'lrr'" in msg and "did you mean 'lr'" in msg


def test_unknown_section(tiny_config):
    assert "unknown section [optimiser]" in one_error_line(train("--config", str(tiny_config()), "--optimiser.lr=1"))


def test_wrong_type(tiny_config):
    msg = one_error_line(train("--config", str(tiny_config()), '--train.steps="ten"'))
    assert "[train].steps: expected int, got str" in msg


def test_unknown_plugin_lists_installed_and_closest(tiny_config):
    msg = one_error_line(train("--config", str(tiny_config()), "--optimizer.name=adamw2"))
    assert "no optimizer plugin named 'adamw2'" in msg and "did you mean 'adamw'" in msg and "installed: " in msg


def test_extends_cycle(tmp_path):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    assert "extends cycle" in one_error_line(train("--config", str(tmp_path / "a.toml")))


def test_indivisible_batch_shows_numbers(tiny_config):
    msg = one_error_line(train("--config", str(tiny_config()), "--train.global_batch_tokens=1000"))
    assert "1000 is not divisible by train.micro_batch (2) x data.seq_len (128) x world size (1) = 256" in msg


def test_data_missing(tiny_config, tmp_path):
    msg = one_error_line(train("--config", str(tiny_config()), f"--data.path={tmp_path / 'nodata'}"))
    assert "nodata" in msg and "does not exist" in msg


def test_token_ids_beyond_vocab(tiny_config, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    np.arange(1000, dtype=np.uint16).tofile(d / "train.bin")
    msg = one_error_line(train("--config", str(tiny_config()), f"--data.path={d}", "--model.vocab_size=600"))
    assert "train.bin holds token id 999, not below the model's vocabulary 600" in msg


def test_plugin_that_fails_to_import_names_plugin_and_distribution(tmp_path, tiny_config):
    site = tmp_path / "site"
    pkg = site / "broken_plait_plugin"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('boom at import')\n")
    dist = site / "broken_plait_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plait-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[plait]\nbroken = broken_plait_plugin\n")
    import os

    env = {"PYTHONPATH": str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = run_module("core.train", "--config", str(tiny_config()), extra_env=env)
    msg = one_error_line(proc)
    assert "plugin 'broken' (distribution broken-plait-plugin" in msg and "boom at import" in msg
    # the allow-list leaves it out
    proc = run_module("core.plugins", extra_env={**env, "PLAIT_PLUGINS": ""})
    assert proc.returncode == 0, proc.stderr


def test_duplicate_component_across_distributions(tmp_path, tiny_config):
    site = tmp_path / "site"
    pkg = site / "dup_plait_plugin"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from core.hookspecs import hookimpl\n"
        "from plugins.optim.adamw import AdamW, AdamWOptions\n"
        "@hookimpl\n"
        "def plait_register(registry):\n"
        "    registry.add('optimizer', 'adamw', AdamW, options=AdamWOptions, doc='a copy')\n"
    )
    dist = site / "dup_plait_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dup-plait-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[plait]\ndup = dup_plait_plugin\n")
    import os

    proc = run_module("core.plugins", extra_env={"PYTHONPATH": str(site) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    msg = one_error_line(proc)
    assert "optimizer 'adamw' is claimed twice" in msg and "distribution plait" in msg and "distribution dup-plait-plugin" in msg
