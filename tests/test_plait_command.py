"""The ``plait`` console script (core/cli/main.py) and ``plait train --nproc N`` (core/cli/launch.py):
one command table, the pre-flight once in the launcher, the ranks started by torch's elastic
launcher, and the ranks' exit codes out of ``plait train``. Run as ``python -m core.cli.main``
(what the installed ``plait`` script calls)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from conftest import REPO, read_metrics, run_here, run_module

from core.cli import main as plait


def plait_cmd(*args: str, **kw):
    return run_module("core.cli.main", *args, **kw)


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
    assert "plugins2  the plugins again" in plait.usage()


# --- plait train ------------------------------------------------------------------------------


def test_plait_train_nproc_2_trains_two_ranks_with_the_overrides(tiny_config, tmp_path):
    cfg = tiny_config(steps=5)
    proc = plait_cmd("train", "--config", str(cfg), "--nproc", "2", "--train.steps=3", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    assert json.loads((out / "run_info.json").read_text())["world_size"] == 2
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]  # --train.steps=3 reached the ranks, not the file's 5
    assert "Traceback" not in proc.stderr


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


def test_a_ranks_exit_code_comes_out_of_plait_train(tiny_config, tmp_path):
    """The budget guard's stop without a checkpoint: exit 76 on every rank (torchrun says 1)."""
    (tmp_path / "clock").write_text("1800000000")
    stamp = "2027-01-15T08:00:00+00:00"  # the fake clock's time
    (tmp_path / "budget.json").write_text(
        json.dumps({"spent_usd": 36, "rate_usd_per_hr": 1.5, "hours_elapsed": 3.0, "projected_total_usd": 40, "last_update_utc": stamp})
    )
    body = f'[monitors.budget_guard]\nbudget_file = "{tmp_path / "budget.json"}"\nwarn_usd = 30.0\ncap_usd = 35.0\ncheck_every_s = 0.0\n'
    cfg = tiny_config(steps=3, body=body)
    env = {"PLAIT_TEST_CLOCK_FILE": str(tmp_path / "clock"), "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])}
    proc = plait_cmd("train", "--config", str(cfg), "--nproc", "2", '--monitors.enabled=["console", "jsonl", "budget_guard"]', extra_env=env, timeout=300)
    assert proc.returncode == 76, proc.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "exit_status.json").read_text())["exit_code"] == 76
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr


def test_sigterm_to_plait_train_stops_the_ranks_with_a_checkpoint_and_exit_0(tiny_config, tmp_path):
    """torchrun ends with exit 1 and a SignalException traceback; plait train exits with the code rank 0
    recorded for the stop (0: stopped by a signal, with a checkpoint), as one process would."""
    import signal
    import subprocess
    import time

    from conftest import PY, env

    cfg = tiny_config(steps=5000)
    extra = env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="600")  # torch's SIGKILL after the stop's grace: not on a loaded machine
    proc = subprocess.Popen(
        [PY, "-m", "core.cli.main", "train", "--config", str(cfg), "--nproc", "2"],
        cwd=REPO,
        env=extra,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics, deadline = tmp_path / "out" / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # a step is done: the ranks train
    out, err = proc.communicate(timeout=600)
    status = json.loads((tmp_path / "out" / "exit_status.json").read_text())
    assert proc.returncode == 0 and status["reason"] == "signal", err[-3000:]
    assert (tmp_path / "out" / "checkpoints" / f"step_{status['step']:09d}" / "COMMITTED").is_file()
    assert "Traceback" not in err and "SignalException" not in err


def test_two_nodes_each_with_its_own_node_rank_make_one_run(tiny_config, tmp_path):
    """Two ``plait train`` launchers (here on one machine), one rank each, met at node 0's endpoint."""
    import subprocess

    from conftest import PY, env, free_port

    cfg, endpoint = tiny_config(steps=2), f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            [PY, "-m", "core.cli.main", "train", "--config", str(cfg), "--nproc", "1", "--nnodes", "2", "--node-rank", str(r), "--rdzv-endpoint", endpoint],
            cwd=REPO,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (1, 0)
    ]
    ends = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in ends]
    assert json.loads((tmp_path / "out" / "run_info.json").read_text())["world_size"] == 2
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2]


def test_plait_train_without_nproc_is_core_train(tiny_config, tmp_path):
    proc = plait_cmd("train", "--config", str(tiny_config(steps=2)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "run_info.json").read_text())["world_size"] == 1
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2]


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


def test_the_torchrun_command_line():
    from core.cli import launch

    one = SimpleNamespace(nproc=2, nnodes=1, node_rank=0, rdzv_endpoint=None, config="c.toml")
    assert launch.torchrun_argv(one, ["--train.steps=3"]) == [
        "--nproc-per-node", "2", "--standalone", "-m", "core.train", "--config", "c.toml", "--train.steps=3"
    ]  # fmt: skip
    two = SimpleNamespace(nproc=4, nnodes=2, node_rank=1, rdzv_endpoint="node0:29500", config="c.toml")
    argv = launch.torchrun_argv(two, [])
    from torch.distributed.run import parse_args

    parsed = parse_args(argv)  # torch's own parser takes it
    assert (parsed.nproc_per_node, parsed.nnodes, parsed.node_rank, parsed.rdzv_endpoint) == ("4", "2", 1, "node0:29500")
    assert parsed.module and parsed.training_script == "core.train" and parsed.training_script_args == ["--config", "c.toml"]


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
