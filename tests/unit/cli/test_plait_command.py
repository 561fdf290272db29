"""The ``plait`` console script (core/cli/main.py), its ``main`` in this process: one command table (help
lists it, an unknown command is one line, a command gets the same flags and output as its module, a new
command joins with one entry), ``plait train --nproc`` checks bad input and its launcher flags before any
rank starts and maps failed ranks' exit codes, ``plait plan`` shows the whole plan (and as JSON), and
``plait lm-eval`` is the harness command line with plait registered."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import run_here

from core.cli import main as plait


def test_help_lists_every_command_of_the_table():
    proc = run_here("core.cli.main", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: plait <command>")
    listed = [line.split()[0] for line in proc.stdout.split("commands:\n", 1)[1].splitlines() if line.strip()]
    assert listed == list(plait.COMMANDS) and {"train", "plan", "plugins", "export", "generate", "report"} <= set(listed)


def test_an_unknown_command_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        plait.main(["plna", "--config", "x.toml"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("plait: error: command line: unknown command 'plna' (did you mean 'plan'?)")


def test_a_command_gets_the_same_flags_and_gives_the_same_output(capsys):
    from core.cli import plugins

    assert plugins.main(["--slot", "optimizer"]) == 0
    direct = capsys.readouterr().out
    assert plait.main(["plugins", "--slot", "optimizer"]) == 0
    assert capsys.readouterr().out == direct and "adamw" in direct


def test_a_new_command_joins_with_one_entry(monkeypatch, capsys):
    """``plait eval`` (or any command) is one line in COMMANDS: a module with main(argv)."""
    monkeypatch.setitem(plait.COMMANDS, "plugins2", plait.Command("core.cli.plugins", "the plugins again"))
    assert plait.main(["plugins2", "--slot", "lr_schedule"]) == 0
    assert "warmup_cosine" in capsys.readouterr().out
    width = max(map(len, plait.COMMANDS))
    assert f"  {'plugins2':<{width}}  the plugins again" in plait.usage()


@pytest.mark.parametrize(
    "args, named",
    [
        (["--data.path=/nonexistent/plait-data"], "/nonexistent/plait-data does not exist"),
        (["--optimizer.lr=nan"], ".lr: expected a number, got nan"),
    ],
)
def test_bad_input_under_nproc_is_one_line_exit_2_and_no_rank(tiny_config, tmp_path, args, named):
    proc = run_here("core.cli.main", "train", "--config", str(tiny_config()), "--nproc", "2", *args)  # refused before any process starts
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("plait: error: ") and named in lines[0], lines
    assert not (tmp_path / "out").exists()  # no rank started, no folder left behind


@pytest.mark.parametrize(
    "args, said",
    [
        (["--nnodes", "2", "--nproc", "2"], "--nnodes above 1 needs --rdzv-endpoint"),
        (["--nnodes", "2"], "need --nproc"),
        (["--nproc", "0"], "expected integers >= 1"),
        (["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", "node0:"], "--rdzv-endpoint: expected HOST:PORT with a port 1..65535, got 'node0:'"),
        (["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", "29500"], "expected HOST:PORT"),
        (["--nproc", "2", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank: expected 0..1, got 2"),
    ],
)
def test_launcher_flags_are_checked(capsys, args, said):
    from core.cli import launch

    with pytest.raises(SystemExit) as e:
        launch.parse_args(["--config", "x.toml", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and said in err, err


def failure(code: int, at: float):
    return SimpleNamespace(exitcode=code, timestamp=at)


@pytest.mark.parametrize(
    "failures, code",
    [
        ({0: failure(3, 10), 1: failure(3, 11)}, 3),  # every rank's own code
        ({0: failure(-15, 10), 1: failure(74, 11)}, 74),  # a rank stopped by the launcher: the other's code
        ({0: failure(-9, 10), 1: failure(-15, 11)}, 137),  # killed: 128 + the first signal
        ({0: failure(1, 12), 1: failure(2, 11)}, 2),  # the first to fail
    ],
)
def test_the_exit_code_of_failed_ranks(failures, code):
    from core.cli import launch

    assert launch.rank_exit_code(failures) == code


# --- core.plan with what does not exist yet -----------------------------------------------------


def test_plan_shows_the_whole_plan_and_lists_missing_data_and_checkpoint(tiny_config, tmp_path, capsys):
    from core.cli import plan

    cfg = tiny_config()
    capsys.readouterr()
    code = plan.main(["--config", str(cfg), f"--data.path={tmp_path / 'nodata'}", f"--checkpoint.resume={tmp_path / 'nockpt'}", "--tokens-per-s=1000"])
    out = capsys.readouterr()
    assert code == 2
    for part in ("parameters  ", "FLOPs/token", "batch       1,024 tokens/step", "memory/rank", "ETA: ", "[optimizer] lr="):
        assert part in out.out, (part, out.out)
    problems = out.out.split("problems    ", 1)[1]
    assert f"{tmp_path / 'nodata'} does not exist" in problems and f"checkpoint {tmp_path / 'nockpt'} does not exist" in problems
    errors = out.err.strip().splitlines()
    assert len(errors) == 2 and all(e.startswith("plait: error: ") for e in errors), out.err
    assert not (tmp_path / "out").exists()


def test_plan_json_lists_the_problems_and_every_plugins_options(tiny_config, tmp_path, capsys):
    from core.cli import plan

    capsys.readouterr()
    assert plan.main(["--config", str(tiny_config()), "--json", "--optimizer.lr=0.002"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["problems"] == []
    assert got["options"]["optimizer"]["lr"] == 0.002 and got["options"]["data"]["seq_len"] == 128
    assert set(got["options"]) == {"model", "parallelism", "precision", "data", "optimizer", "lr_schedule", "monitors.console", "monitors.jsonl"}


def test_lm_eval_is_the_harness_command_line_with_plait_registered(capsys, monkeypatch):
    """``plait lm-eval ...`` is lm-evaluation-harness's own command line, with the model ``plait``
    registered; without the extra 'eval' installed it is one line naming it, exit 2."""
    import sys

    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the optional extra 'eval' (in 'dev')")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as e:
        plait.main(["lm-eval", "run", "--help"])
    assert e.value.code == 0
    assert "--model_args" in capsys.readouterr().out
    from lm_eval.api.registry import get_model

    from core.cli.lm_eval_model import PlaitLM

    assert get_model("plait") is PlaitLM
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if the extra were not installed
    monkeypatch.delitem(sys.modules, "core.cli.lm_eval_model")
    with pytest.raises(SystemExit) as e:
        plait.main(["lm-eval", "--help"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "plait lm-eval: needs lm_eval" in err and "pip install -e '.[eval]'" in err


def test_lm_eval_help_says_what_plait_adds_and_names_every_model_arg(capsys, monkeypatch):
    """``plait lm-eval --help`` exits 0 with plait's lines (every keyword ``PlaitLM`` takes, as a
    ``--model_args`` key) and then the harness's own help, its flags passed to it unchanged."""
    import inspect
    import sys

    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the optional extra 'eval' (in 'dev')")
    from core.cli.lm_eval_model import PlaitLM

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    keys = [p.name for p in inspect.signature(PlaitLM.__init__).parameters.values() if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]
    assert "checkpoint" in keys and "device" in keys
    for argv in (["lm-eval", "--help"], ["lm-eval", "run", "-h"]):
        with pytest.raises(SystemExit) as e:
            plait.main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        plait_part, harness_part = out.split("usage: lm-eval", 1)
        assert "What plait adds over lm_eval" in plait_part and "--model plait --model_args checkpoint=DIR" in plait_part
        for key in keys:
            assert f"\n    {key} " in plait_part, key  # one line per model_args key
        assert "no conversion" in plait_part and "falls back to cuda:0" in plait_part and "exit 2" in plait_part
    assert "--model_args" in harness_part and "--tasks" in harness_part  # the harness's own run --help follows
