"""``plait train --nproc N`` (core/cli/launch.py) run as ``python -m core.cli.main`` (what the installed
``plait`` script calls): it trains two ranks with the overrides, a rank's exit code comes out of it,
SIGTERM stops the ranks with a checkpoint and exit 0, two nodes with their own node ranks make one run,
without ``--nproc`` it is ``core.train``, and its torchrun command line."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from conftest import REPO, read_metrics, run_module


def plait_cmd(*args: str, **kw):
    return run_module("core.cli.main", *args, **kw)


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
