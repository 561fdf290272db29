"""TOML loading: extends, deep merge, cycles, overrides, option validation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from core.config import files as config
from core.contract.errors import ConfigError
from core.contract.option_values import build_options
from core.contract.options import describe, option


def write(path, text):
    path.write_text(text)
    return path


def test_extends_deep_merge_relative(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "base.toml", '[train]\nsteps = 5\nseed = 1\n[optimizer]\nname = "adamw"\nlr = 1.0\n')
    write(tmp_path / "sub" / "mid.toml", 'extends = "../base.toml"\n[train]\nsteps = 7\n')
    child = write(tmp_path / "sub" / "child.toml", 'extends = "mid.toml"\n[optimizer]\nlr = 2.0\n')
    cfg = config.load_file(child)
    assert cfg == {"train": {"steps": 7, "seed": 1}, "optimizer": {"name": "adamw", "lr": 2.0}}


def test_extends_list_later_wins(tmp_path):
    write(tmp_path / "a.toml", "[x]\nv = 1\nw = 1\n")
    write(tmp_path / "b.toml", "[x]\nv = 2\n")
    c = write(tmp_path / "c.toml", 'extends = ["a.toml", "b.toml"]\n')
    assert config.load_file(c) == {"x": {"v": 2, "w": 1}}


def test_extends_cycle_detected(tmp_path):
    write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    write(tmp_path / "b.toml", 'extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="extends cycle: .*a.toml -> .*b.toml -> .*a.toml"):
        config.load_file(tmp_path / "a.toml")


def test_missing_file_and_missing_parent(tmp_path):
    with pytest.raises(ConfigError, match="config file .*nope.toml not found"):
        config.load_file(tmp_path / "nope.toml")
    c = write(tmp_path / "c.toml", 'extends = "gone.toml"\n')
    with pytest.raises(ConfigError, match="gone.toml not found \\(extended by .*c.toml\\)"):
        config.load_file(c)


def test_invalid_toml_names_file(tmp_path):
    bad = write(tmp_path / "bad.toml", "[train\nsteps = 1\n")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        config.load_file(bad)


def test_overrides_parse_as_toml_literals():
    got = dict(
        config.parse_overrides(
            [
                "--optimizer.lr=1e-4",
                "--train.steps",
                "10",
                "--optimizer.betas=[0.9, 0.99]",
                "--data.path=some/dir",
                '--model.flavor="1b"',
                "--budget.force",
                "--a.b.c=true",
            ]
        )
    )
    assert got == {
        "optimizer.lr": 1e-4,
        "train.steps": 10,
        "optimizer.betas": [0.9, 0.99],
        "data.path": "some/dir",
        "model.flavor": "1b",
        "budget.force": True,
        "a.b.c": True,
    }


def test_apply_overrides_nested_and_errors():
    cfg = config.apply_overrides({"a": {"x": 1}}, [("a.y.z", 2), ("a.x", 3)])
    assert cfg == {"a": {"x": 3, "y": {"z": 2}}}
    with pytest.raises(ConfigError, match="'x' is a value"):
        config.apply_overrides({"a": {"x": 1}}, [("a.x.q", 2)])
    with pytest.raises(ConfigError, match="expected --section.key=value"):
        config.parse_overrides(["lr=1"])


def test_dumps_round_trips():
    cfg = {
        "train": {"steps": 3, "lr": 0.5, "name": 'a "q"', "flag": True, "betas": [0.9, 0.95]},
        "monitors": {"enabled": ["console"], "console": {"extra": []}},
        "m": {"d": {"k": 1}},
    }
    assert config.tomllib.loads(config.dumps(cfg)) == cfg


@dataclass
class Opts:
    lr: float = option(1e-3, "learning rate")
    steps: int = option(1, "steps")
    mode: Literal["a", "b"] = option("a", "mode")
    betas: tuple[float, float] = option((0.9, 0.95), "betas")
    names: list[str] = option([], "names")
    is_async: bool = option(False, "async", key="async")


def test_build_options_types_and_coercion():
    o = build_options(Opts, {"lr": 1, "betas": [0.8, 0.9], "mode": "b", "async": True}, "[x]")
    assert o.lr == 1.0 and isinstance(o.lr, float) and o.betas == (0.8, 0.9) and o.mode == "b" and o.is_async


@pytest.mark.parametrize(
    "table, match",
    [
        ({"lrr": 1.0}, r"\[x\]: unknown key 'lrr' \(did you mean 'lr'\?\)"),
        ({"steps": 1.5}, r"\[x\].steps: expected int, got float 1.5"),
        ({"steps": True}, r"\[x\].steps: expected int, got bool"),
        ({"mode": "c"}, r"\[x\].mode: expected 'a' \| 'b'"),
        ({"betas": [1, 2, 3]}, r"\[x\].betas: expected tuple\[float, float\]"),
        ({"names": [1]}, r"\[x\].names: expected list\[str\]"),
    ],
)
def test_build_options_errors(table, match):
    with pytest.raises(ConfigError, match=match):
        build_options(Opts, table, "[x]")


def test_describe_uses_toml_keys_and_docs():
    rows = {r[0]: r for r in describe(Opts)}
    assert rows["async"][1:] == ("bool", False, "async")
    assert rows["betas"][2] == (0.9, 0.95)


def test_path_options_resolve_against_the_file_that_set_them(tmp_path):
    """A relative path in a config is relative to that config's folder (through extends too); one
    given on the command line is relative to the working directory."""
    from core.config.files import load, subtable
    from plugins.data.token_bin import TokenBinOptions

    (tmp_path / "parent").mkdir()
    (tmp_path / "child").mkdir()
    (tmp_path / "parent" / "base.toml").write_text('[data]\nname = "token_bin"\npath = "corpus"\n')
    (tmp_path / "child" / "run.toml").write_text('extends = "../parent/base.toml"\n')
    cfg = load(tmp_path / "child" / "run.toml")
    opts = build_options(TokenBinOptions, subtable(cfg["data"], ("name",)), "[data]")
    assert opts.path == str(tmp_path / "parent" / "corpus")
    cfg = load(tmp_path / "child" / "run.toml", ["--data.path=here/corpus"])
    opts = build_options(TokenBinOptions, subtable(cfg["data"], ("name",)), "[data]")
    assert opts.path == str(Path.cwd() / "here" / "corpus")


def test_switching_a_plugin_drops_the_old_plugins_keys(tmp_path):
    (tmp_path / "parent.toml").write_text(
        '[data]\nname = "token_bin"\npath = "corpus"\nseq_len = 64\n'
        '[lr_schedule]\nname = "warmup_cosine"\nmin_lr_ratio = 0.1\n'
        '[precision]\nfallback = ["mxfp8", "fp8", "bf16"]\n[precision.fp8]\nrecipe = "rowwise"\n'
        "[optimizer]\nlr = 1e-3\n"
    )
    (tmp_path / "child.toml").write_text('extends = "parent.toml"\n[data]\nname = "mixture"\nsources = []\n[optimizer]\nname = "adamw"\n')
    cfg = config.load(tmp_path / "child.toml")
    assert "path" not in cfg["data"]
    assert cfg["optimizer"]["lr"] == 1e-3  # naming the default plugin is no switch: its keys stay
    cfg = config.load(tmp_path / "child.toml", ["--lr_schedule.name=constant", "--lr_schedule.warmup_steps=5"])
    assert dict(cfg["lr_schedule"]) == {"name": "constant", "warmup_steps": 5}
    # an explicit precision wins over the fallback chain, keeping that entry's own options
    cfg = config.load(tmp_path / "parent.toml", ["--precision.name=fp8"])
    assert dict(cfg["precision"]) == {"name": "fp8", "recipe": "rowwise"}
    # "@default" removes an inherited key
    cfg = config.load(tmp_path / "parent.toml", ["--optimizer.lr=@default"])
    assert "lr" not in cfg["optimizer"]


def test_output_folders_starting_with_a_tilde_are_in_the_home_folder(tiny_config, tmp_path, monkeypatch, capsys):
    """Path options (data.path, ...) took ``~`` for the home folder, the output folders did not: ``output_dir
    = "~/runs/x"`` (no shell expands it in a TOML file, nor after ``--key=``) made a folder named ``~`` in the
    working directory, and a rented machine's checkpoints went to its scratch disk instead of the home volume."""
    from core.cli.plan import main

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(["--config", str(tiny_config()), "--train.output_dir=~/runs/x", "--checkpoint.dir=~/ckpts", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["output_dir"] == str(tmp_path / "home" / "runs" / "x")
    from core.config.sections import CheckpointOptions
    from core.contract.option_values import build_options

    assert build_options(CheckpointOptions, {"dir": "~/ckpts"}, "[checkpoint]").dir == str(tmp_path / "home" / "ckpts")
    assert not (tmp_path / "~").exists()
