"""Every kind of bad input exits with code 2 and one clear line, before any process group or model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO, run_module, write_tiny_config
from shared import token_bin_source


def train(*args):
    return run_module("core.train", *args, timeout=60)


def one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("plait: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    # nothing on stdout, or (core.plan with a data or checkpoint problem) the plan with the problem listed under it
    assert proc.stdout == "" or lines[0].removeprefix("plait: error: ") in proc.stdout, proc.stdout[-2000:]
    return lines[0]


def test_missing_config_file(tmp_path):
    assert "config file" in one_error_line(train("--config", str(tmp_path / "nope.toml")))


def test_unknown_key_with_suggestion(tiny_config):
    msg = one_error_line(train("--config", str(tiny_config()), "--optimizer.lrr=1e-3"))
    assert "[optimizer]" in msg and "'lrr'" in msg and "did you mean 'lr'" in msg


def test_unknown_section(tiny_config):
    assert "unknown section [optimiser]" in one_error_line(train("--config", str(tiny_config()), "--optimiser.lr=1"))


def test_an_override_without_a_section_is_named(tiny_config):
    msg = one_error_line(train("--config", str(tiny_config()), "--steps=5"))
    assert msg == "plait: error: command line: '--steps=5' names no section; expected --section.key=value (did you mean --train.steps?)"


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
        "from core.contract.hookspecs import hookimpl\n"
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


def test_bad_resume_or_initial_load_leaves_no_run_folder_behind(tiny_config, tmp_path):
    """A checkpoint.resume that does not exist is found before anything is created: no output_dir,
    checkpoints folder or plait.lock is left behind. initial_load
    can only be checked once no checkpoint is found to resume from (after the folders exist):
    its failure removes the folders this start made, and nothing that was there before."""
    from core.contract.errors import PlaitError
    from core.preflight.prepare import prepare
    from core.runtime.ownership import release_run_folders

    out = tmp_path / "runs" / "a" / "out"
    msg = one_error_line(train("--config", str(tiny_config()), f"--train.output_dir={out}", f"--checkpoint.resume={tmp_path / 'nope'}"))
    assert "nope does not exist" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]  # not even runs/

    def start(output_dir):  # what core.train's rank 0 prepares (the lock included), in this process
        with pytest.raises(PlaitError, match=r"weights .*nope not found"):
            prepare(str(tiny_config()), [f"--train.output_dir={output_dir}", f"--checkpoint.initial_load={tmp_path / 'nope'}"], lock=True)
        release_run_folders()

    start(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]
    (tmp_path / "mine").mkdir()  # folders that were there before stay, with what they hold
    (tmp_path / "mine" / "notes.txt").write_text("x")
    start(tmp_path / "mine")
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt", "plait.lock"]


def test_train_argparse_errors_are_one_line(capsys):
    from core.cli import train

    with pytest.raises(SystemExit) as exc:
        train.main(["--config"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1
    assert err[0].startswith("plait: error: command line: argument --config: expected one argument")


def test_train_records_bad_input_for_launchers(tiny_config, tmp_path, capsys, monkeypatch):
    """Under torchrun a child's exit code 2 becomes 1: exit_status.json tells remote.sh not to retry."""

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from core.cli import train

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    (tmp_path / "out").mkdir()
    with pytest.raises(SystemExit) as exc:
        train.main(["--config", str(tiny_config()), "--optimizer.eps=-1"])
    assert exc.value.code == 2
    status = json.loads((tmp_path / "out" / "exit_status.json").read_text())
    assert status["exit_code"] == 2 and status["reason"] == "bad_input" and "eps" in status["detail"]
    # torchrun's failure summary names the reason, read from the error file it gave the rank
    line = capsys.readouterr().err.strip()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(tmp_path / "error.json"))
    summary = ChildFailedError("core.train", {0: failure}).format_msg()
    assert line.startswith("plait: error:") and f"traceback : {line}" in summary and "To enable traceback" not in summary


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--optimizer.betas=[1.5, 0.99]"], "betas: each must be >= 0 and < 1, got 1.5"),
        (["--checkpoint.dir=/proc/x"], "[checkpoint].dir = /proc/x: cannot create or write a file there"),
        (["--=5"], "bad key in '--=5'"),
    ],
)
def test_train_exits_2_with_one_line(tiny_config, args, expected):
    assert expected in one_error_line(train("--config", str(tiny_config()), *args))


# --- data -----------------------------------------------------------------------------------------


# --- launchers/remote.sh: numbers from the environment ------------------------------------------


@pytest.mark.parametrize(
    "var, value", [("MICRO_BATCH", "HOME[$(touch {marker})]"), ("GRAD_ACCUM", "PATH[$(touch {marker})]"), ("BACKOFF_S", "08"), ("NPROC", "2; touch {marker}")]
)
def test_remote_refuses_non_numeric_environment(tmp_path, var, value):
    import os
    import subprocess
    import sys

    marker = tmp_path / "pwned"
    e = dict(os.environ, PYTHON=sys.executable, OUTPUT_DIR=str(tmp_path / "out"), MICRO_BATCH="2", SEQ_LEN="128", GRAD_ACCUM="1")
    e[var] = value.format(marker=marker)
    proc = subprocess.run(["bash", "launchers/remote.sh"], cwd=REPO, env=e, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"plait: error: remote.sh: {var} = " in proc.stderr and "expected a non-negative decimal integer" in proc.stderr
    assert not marker.exists() and "torch " not in proc.stdout  # refused before python or arithmetic ran


def test_a_config_of_megabytes_or_of_a_million_keys_is_one_line_unparsed(tmp_path, tiny_config):
    from core.config import files as config_io
    from core.contract.errors import ConfigError

    huge = tmp_path / "huge.toml"
    with huge.open("w") as f:  # 26 MB of keys: refused by its size, never parsed
        f.write("[train]\n")
        for i in range(1_500_000):
            f.write(f"k{i} = {i}\n")
    with pytest.raises(ConfigError, match=r"huge.toml: larger than 1 MiB"):
        config_io.load(huge)
    many = tmp_path / "many.toml"
    many.write_text("[train]\nk = [" + "1," * 150_000 + "]\n")  # under 1 MiB, past the count of values
    with pytest.raises(ConfigError, match=r"many.toml: more than 100000 keys and array items"):
        config_io.load(many)
    with pytest.raises(ConfigError, match=r"command line: longer than"):
        config_io.load(tiny_config(), ["--train.k=[" + "1," * 600_000 + "]"])
    parts = [tmp_path / f"part{i}.toml" for i in range(3)]  # each file under the count, the merge over it
    for i, p in enumerate(parts):
        p.write_text(f"[s{i}]\nk = [" + "1," * 40_000 + "]\n")
    (tmp_path / "top.toml").write_text(f"extends = {[p.name for p in parts]!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError, match=r"top.toml: with its extends and overrides, more than 100000"):
        config_io.load(tmp_path / "top.toml")
    msg = one_error_line(train("--config", str(huge)))
    assert "huge.toml: larger than 1 MiB" in msg


def test_token_bin_ids_past_the_vocabulary_meta_json_declares_are_refused(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    np.random.default_rng(0).integers(1, 500, 40_000).astype(np.uint16).tofile(d / "train.bin")
    (d / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 300}')
    cfg = write_tiny_config(tmp_path)
    for module in ("core.train", "core.plan"):
        msg = one_error_line(run_module(module, "--config", str(cfg), f"--data.path={d}", timeout=60))
        assert "train.bin holds token id 499, not below the vocab_size 300 that" in msg and "meta.json declares" in msg, msg
    (d / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 500}')
    token_bin_source(d).validate(512, 32)
