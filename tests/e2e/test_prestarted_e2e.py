"""The suite's warm-interpreter launcher (tests/prestarted.py) runs a command as a fresh interpreter
and torchrun would: the same outputs, losses, exit codes, environment and working directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import prestarted
import pytest
from conftest import PY, REPO, env, read_metrics, real_torchrun, run_module, torchrun


def fresh(module: str, *args: str, cwd=REPO, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", module, *args], cwd=cwd, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=300)


def test_a_command_prints_and_exits_as_in_a_fresh_interpreter(tmp_path):
    warm, cold = run_module("core.plugins"), fresh("core.plugins")
    assert warm.returncode == cold.returncode == 0
    assert warm.stdout == cold.stdout and "llama3" in warm.stdout
    bad = ("--config", str(tmp_path / "missing.toml"))
    warm, cold = run_module("core.train", *bad), fresh("core.train", *bad)
    assert warm.returncode == cold.returncode == 2
    assert warm.stderr == cold.stderr and "missing.toml" in warm.stderr


def test_a_command_sees_its_own_working_directory_environment_and_path(tmp_path, tiny_config):
    cfg = tiny_config(steps=2)
    site = tmp_path / "site"
    site.mkdir()
    # A relative output folder lands in the command's working directory; a PYTHONPATH entry is importable
    # (a data source of another package would be found the same way); the environment is the command's own.
    (site / "probe_env.py").write_text("import os\nVALUE = os.environ.get('PLAIT_PROBE')\n")
    (tmp_path / "use.toml").write_text(cfg.read_text().replace(f'"{tmp_path / "out"}"', '"rel_out"'))
    proc = run_module("core.train", "--config", str(tmp_path / "use.toml"), cwd=tmp_path, extra_env={"PYTHONPATH": str(site), "PLAIT_PROBE": "seen"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "rel_out" / "metrics.jsonl").exists()
    assert prestarted.can_run("core.train", env(PYTHONPATH=str(site)), env())
    assert not prestarted.can_run("plugins.data.prepare", env(), env())  # must start without torch: fresh
    assert not prestarted.can_run("core.train", env(OMP_NUM_THREADS="2"), env())  # read when torch loads: fresh
    assert not prestarted.can_run("core.train", env(TORCHDYNAMO_DISABLE="1"), env())  # so are torch's own settings
    # plait's modules come from the warm interpreter that has imported them unless the seams would patch them
    # before they load, or another plait package would be found first
    assert prestarted.plait_is_shared(env(PYTHONPATH=str(site)), tmp_path)
    assert not prestarted.plait_is_shared(env(PYTHONPATH=str(REPO / "tests" / "seams")), REPO)
    (site / "plugins").mkdir()
    assert not prestarted.plait_is_shared(env(PYTHONPATH=str(site)), REPO) and not prestarted.plait_is_shared(env(), site)


def test_a_sitecustomize_on_pythonpath_acts_as_at_interpreter_start(tiny_config, tmp_path):
    """The test seams (tests/seams/sitecustomize.py) patch plait before the command runs, warm as fresh."""
    cfg = tiny_config(steps=4)
    seams = {"PYTHONPATH": str(REPO / "tests" / "seams"), "PLAIT_TEST_CRASH_AT_STEP": "3"}
    runs = []
    for name, run in (("warm", run_module), ("cold", fresh)):
        proc = run("core.train", "--config", str(cfg), f"--train.output_dir={tmp_path / name}", extra_env=seams)
        runs.append(proc)
        assert proc.returncode != 0 and [r["step"] for r in read_metrics(tmp_path / name)] == [1, 2], proc.stderr[-2000:]
    assert runs[0].returncode == runs[1].returncode


@pytest.mark.slow
def test_a_two_rank_job_has_torchruns_losses_and_exit_codes(tiny_config, tmp_path):
    cfg = tiny_config(steps=4)
    warm = torchrun(2, "--config", str(cfg), f"--train.output_dir={tmp_path / 'warm'}")
    cold = real_torchrun(2, "--config", str(cfg), f"--train.output_dir={tmp_path / 'cold'}")
    assert warm.returncode == cold.returncode == 0, warm.stderr[-2000:] + cold.stderr[-2000:]
    assert [r["loss"] for r in read_metrics(tmp_path / "warm")] == [r["loss"] for r in read_metrics(tmp_path / "cold")]  # bitwise
    # One rank refusing its input ends the job with exit 1, as under torchrun, without waiting on the other.
    bad = ("--config", str(cfg), f"--train.output_dir={tmp_path / 'bad'}", f"--checkpoint.resume={tmp_path / 'nowhere'}")
    warm, cold = torchrun(2, *bad, timeout=120), real_torchrun(2, *bad, timeout=120)
    assert warm.returncode == cold.returncode == 1
    assert "nowhere" in warm.stderr


def test_a_started_command_is_a_process_group_of_its_own_that_signals_and_kills_reach(tiny_config, tmp_path):
    """``start_module``: the returned process's pid leads its process group, SIGTERM to that group
    stops the run at a step boundary as it stops a fresh interpreter's (exit code 0, reason signal),
    SIGKILL gives -9 as Popen reports it, and the outputs come back through ``communicate``: apart,
    merged (``stderr=STDOUT``) or into an open file."""
    import json
    import os
    import signal
    import time

    from conftest import start_module

    cfg = tiny_config(steps=100000)
    out = tmp_path / "out"
    proc = start_module("core.train", "--config", str(cfg))
    assert isinstance(proc, prestarted.Process) or os.environ.get("PLAIT_TEST_FRESH_INTERPRETERS")  # else Popen, held to the same
    assert os.getpgid(proc.pid) == proc.pid
    deadline = time.time() + 600
    while not ((out / "metrics.jsonl").exists() and read_metrics(out)):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "training ended at step" in stdout + stderr, stderr[-2000:]
    assert json.loads((out / "exit_status.json").read_text())["reason"] == "signal"

    merged = start_module("core.train", "--config", str(tmp_path / "missing.toml"), stderr=subprocess.STDOUT)
    text, nothing = merged.communicate(timeout=120)
    assert merged.returncode == 2 and nothing is None and "missing.toml" in text

    with open(tmp_path / "log", "w") as log:
        held = start_module("core.train", "--config", str(cfg), "--train.output_dir", str(tmp_path / "other"), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while "step 1/" not in (tmp_path / "log").read_text():
            assert held.poll() is None and time.time() < deadline
            time.sleep(0.1)
        held.kill()
        assert held.wait(timeout=60) == -signal.SIGKILL and held.communicate() == (None, None)


def test_a_script_job_sees_what_it_sees_under_torchrun(tmp_path):
    """``torchrun_script``: each rank runs the script as ``__main__`` with its path as ``sys.argv[0]``
    and its folder first on ``sys.path``, torchrun's variables set, and one process group of the
    ranks: what each rank writes is what real torchrun's ranks write."""
    from conftest import torchrun_script

    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(
        "import json, os, sys\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = __import__('torch').tensor([dist.get_rank() + 1])\n"
        "dist.all_reduce(t)\n"
        "seen = dict(name=__name__, argv=sys.argv, first=sys.path[0], rank=os.environ['RANK'], world=dist.get_world_size(), sum=int(t))\n"
        "open(f'{sys.argv[1]}.{dist.get_rank()}', 'w').write(json.dumps(seen))\n"
        "dist.destroy_process_group()\n"
    )
    warm = torchrun_script(2, script, str(tmp_path / "warm"), timeout=120)
    cold = subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(tmp_path / "cold")],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert warm.returncode == cold.returncode == 0, warm.stderr[-2000:] + cold.stderr[-2000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"warm.{rank}").read_text())
        want = json.loads((tmp_path / f"cold.{rank}").read_text())
        assert got["argv"][1:] == [str(tmp_path / "warm")] and want["argv"][1:] == [str(tmp_path / "cold")]
        got["argv"], want["argv"] = got["argv"][0], want["argv"][0]
        assert got == want and got["rank"] == str(rank) and got["sum"] == 3 and got["first"] == str(script.parent), (got, want)


def test_a_warm_interpreter_whose_plait_warm_interpreter_died_is_started_again():
    """The plait warm interpreter is its warm interpreter's child: when it dies (killed, out of memory),
    the next command starts both again and runs."""
    assert prestarted.run("core.plugins", [], nproc=1, env=env(), base=env(), cwd=REPO, timeout=120).returncode == 0
    warm = prestarted._slots[0]
    plait_server = children(warm.proc.pid)[0]  # its oldest live child: forked at its first plait command
    os.kill(plait_server, signal.SIGKILL)
    proc = prestarted.run("core.plugins", [], nproc=1, env=env(), base=env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "llama3" in proc.stdout
    assert warm.proc.wait(timeout=30) == 0 and prestarted._slots[0] is not warm


def children(pid: int) -> list[int]:
    """The live (not zombie) children of ``pid``, oldest first."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            state, parent, started = fields[0], int(fields[1]), int(fields[19])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid and state != "Z":
            found.append((started, int(stat.parent.name)))
    return [child for _, child in sorted(found)]
