"""Multi-node jobs as SLURM and Kubernetes run them: one torchrun agent per node, c10d rendezvous,
here two agents on this host (``--nnodes=2 --nproc_per_node=1``). A node lost mid-run, a restart
of both nodes, and nodes whose checkpoint folders are disks of their own. Longer cases (SIGTERM to
one node, a node that freezes instead of dying, restarts as one node of two processes and back) are
in the ``bench`` marker (``pytest -m bench``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PY, REPO, env, free_port, read_metrics, write_tiny_config

pytestmark = pytest.mark.slow

SEAMS = os.pathsep.join([str(REPO / "tests" / "seams"), str(REPO)])


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def rank_of(pid: int) -> int | None:
    try:
        variables = dict(line.split("=", 1) for line in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in line)
        return int(variables["RANK"])
    except (OSError, KeyError, ValueError):
        return None


class Nodes:
    """Two torchrun agents of one job (``core.train``), each with its own output: the first binds the
    rendezvous endpoint (it serves the c10d store, as the head node does under SLURM)."""

    def __init__(self, tmp_path: Path, args: list[str], per_node: list[list[str]] | None = None, **extra_env: str) -> None:
        self.port = free_port()
        self.started = time.time()
        self.procs: list[subprocess.Popen] = []
        self.logs = [tmp_path / f"node{i}.{time.monotonic_ns()}.log" for i in (0, 1)]
        for i in (0, 1):
            cmd = [
                PY,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.port}",
                f"--rdzv-id=nodes-{self.port}",
                "-m",
                "core.train",
                *args,
                *(per_node[i] if per_node else []),
            ]
            with open(self.logs[i], "w") as log:
                self.procs.append(subprocess.Popen(cmd, cwd=REPO, env=env(**extra_env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            if i == 0:
                self.wait_for_the_store()

    def wait_for_the_store(self) -> None:
        deadline = time.time() + 300  # a wait on the port: long only on a loaded machine
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            assert self.procs[0].poll() is None, self.output(0)
            time.sleep(0.05)
        raise AssertionError("the first agent never served the rendezvous store")

    def node_of_rank(self, rank: int) -> int:
        for i, proc in enumerate(self.procs):
            if any(rank_of(c) == rank for c in children(proc.pid)):
                return i
        raise AssertionError(f"no node runs rank {rank}")

    def kill_node(self, i: int) -> None:
        """SIGKILL the node's rank(s) and its agent together: the machine is gone."""
        for c in children(self.procs[i].pid):
            os.kill(c, signal.SIGKILL)
        os.kill(self.procs[i].pid, signal.SIGKILL)

    def wait(self, which: list[int], timeout: float) -> list[int]:
        deadline = time.time() + timeout
        for i in which:
            try:
                self.procs[i].wait(max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"node {i} did not end within {timeout} s:\n{self.output(i)[-3000:]}") from None
        return [self.procs[i].returncode for i in which]

    def output(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                for c in children(proc.pid):
                    os.kill(c, signal.SIGKILL)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_for_step(out: Path, step: int, nodes: Nodes, timeout: float = 600) -> float:
    """Wait until the run logged ``step``; the seconds since the nodes started: what starting and
    training took on this machine now, the allowance for ending under the same load."""
    deadline = time.time() + timeout
    while not ((out / "metrics.jsonl").exists() and any(r["step"] >= step for r in read_metrics(out))):
        assert time.time() < deadline and all(p.poll() is None for p in nodes.procs), nodes.output(0)[-3000:] + nodes.output(1)[-3000:]
        time.sleep(0.05)
    return time.time() - nodes.started


def test_a_lost_node_ends_the_survivor_with_one_line_and_both_nodes_resume_from_the_last_checkpoint(tmp_path):
    """The node of rank 0, which also serves the store that the stall watchdog publishes to, is lost
    mid-run (its agent and its rank SIGKILLed together). The survivor's collective fails at once; it
    says in one line (not a gloo traceback alone) that another rank is gone, what it was doing and which checkpoint a restart
    resumes from; every committed checkpoint stays sound, and both nodes started again resume from
    the newest one, rank 0's choice being rank 1's."""
    from core.checkpoint.folders import committed, verify

    cfg = write_tiny_config(tmp_path, steps=100, global_batch_tokens=512)  # one micro-batch per rank and step
    out = tmp_path / "out"
    timeouts = ["--train.collective_timeout_s=10", "--train.stall_timeout_s=10", "--checkpoint.every=2"]
    nodes = Nodes(tmp_path, ["--config", str(cfg), *timeouts], PYTHONPATH=SEAMS, PLAIT_TEST_SLOW_READ_S="0.05")
    try:
        load_s = wait_for_step(out, 3, nodes)
        lost = nodes.node_of_rank(0)
        survivor = 1 - lost
        nodes.kill_node(lost)
        t0 = time.time()
        (code,) = nodes.wait([survivor], timeout=600)
        ended_after = time.time() - t0
    finally:
        nodes.stop()
    text = nodes.output(survivor)
    assert code != 0 and ended_after < 30 + load_s, (code, ended_after, load_s, text[-3000:])
    lines = [line for line in text.splitlines() if line.startswith("plait: error: rank 1: another rank is gone (")]
    assert len(lines) == 1, text[-4000:]
    done = committed(out / "checkpoints")
    assert done and all(verify(p)["step"] == int(p.name[5:]) for p in done)  # shards and checksums included
    newest = done[-1]
    assert "a node, or a process of it, was lost; this rank ends too" in lines[0], lines[0]
    assert lines[0].endswith(f"a launcher restarts the run from the last complete checkpoint, {newest}"), lines[0]
    assert not (out / "exit_status.json").exists()  # rank 0 died: the survivor's line is the word

    step = int(newest.name[5:])
    again = Nodes(tmp_path, ["--config", str(cfg), f"--train.steps={step + 2}"])
    try:
        assert again.wait([0, 1], timeout=120) == [0, 0], again.output(0)[-3000:] + again.output(1)[-3000:]
    finally:
        again.stop()
    said = again.output(0) + again.output(1)
    assert said.count(f"plait: resumed from {newest} at step {step} (saved on 2 ranks, now 2)") == 1, said[-3000:]
    assert [r["step"] for r in read_metrics(out)][-2:] == [step + 1, step + 2]
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "completed" and status["step"] == step + 2, status


def test_nodes_whose_checkpoint_folders_are_disks_of_their_own_are_refused_at_the_start(tmp_path):
    """Each node names a checkpoint folder the other does not see (node-local disks where a shared
    file system was meant), which would otherwise train until its first save failed on rank 1 and a
    restart skipped rank 0's checkpoints one by one. Every rank looks for a file rank
    0 wrote into its folder when the process group starts: one line naming the folder and the rank
    that cannot see it, exit_status.json reason bad_input (exit code 2, never restarted), no step
    trained, nothing written in rank 0's folder and the other node's, made by its start, removed again."""
    cfg = write_tiny_config(tmp_path, steps=4, global_batch_tokens=512)
    out = tmp_path / "out"
    folders = [tmp_path / "node0_disk", tmp_path / "node1_disk"]
    nodes = Nodes(tmp_path, ["--config", str(cfg), "--checkpoint.every=2"], per_node=[[f"--checkpoint.dir={f}"] for f in folders])
    try:
        codes = nodes.wait([0, 1], timeout=120)
    finally:
        nodes.stop()
    text = nodes.output(0) + nodes.output(1)
    assert codes == [1, 1], text[-3000:]  # torchrun reports 1 for any failed child; the code is in exit_status.json
    assert (out / "exit_status.json").exists(), text[-6000:]
    status = json.loads((out / "exit_status.json").read_text())
    assert status["exit_code"] == 2 and status["reason"] == "bad_input", status
    lines = [line for line in text.splitlines() if line.startswith("plait: error:")]
    assert len(lines) == 1, text[-3000:]
    mine = next(f for f in folders if lines[0].startswith(f"plait: error: [checkpoint].dir = {f}: rank 1 on "))  # rank 0's node's
    assert f"(its folder: {folders[1 - folders.index(mine)]})" in lines[0], lines[0]
    assert "cannot see the file that rank 0 on" in lines[0] and "not a disk of its own" in lines[0], lines[0]
    assert not (out / "metrics.jsonl").exists() or read_metrics(out) == []
    assert [p.name for p in mine.iterdir() if p.name != "plait.lock"] == []  # rank 0's folder: its lock, nothing else
    assert not folders[1 - folders.index(mine)].exists()  # the other node's start made it, and removed it again


# --- longer cases: `pytest -m bench` ----------------------------------------------------------


def ranks_alive(nodes: Nodes) -> list[int]:
    return [c for proc in nodes.procs if proc.poll() is None for c in children(proc.pid) if rank_of(c) is not None]


def running(pid: int) -> bool:
    """Alive and not a zombie (its agent, stuck on the frozen node's store, may not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_until(condition, timeout: float, what: str) -> float:
    t0 = time.time()
    while not condition():
        assert time.time() - t0 < timeout, what
        time.sleep(0.1)
    return time.time() - t0


@pytest.mark.bench
@pytest.mark.parametrize("node", ["rank 1's", "rank 0's"])
def test_sigterm_to_one_node_stops_both_at_one_step_with_a_checkpoint(tmp_path, node):
    """A pre-emption of one VM (SIGTERM to its agent and its rank; under SLURM a signal to one task): the
    signalled rank's stop reaches the other through the step's control all-reduce, so both stop at the
    same step boundary and save it, every shard of it; rank 0 writes exit_status.json (reason signal)
    and both ranks exit 0. torchrun's agent of the other node may then wait in its exit barrier for the
    signalled one, which never comes, up to 300 s (torch's own): not waited for here."""
    from core.checkpoint.folders import committed, verify

    cfg = write_tiny_config(tmp_path, steps=1000, global_batch_tokens=512)
    out = tmp_path / "out"
    nodes = Nodes(tmp_path, ["--config", str(cfg), "--checkpoint.every=1000"], PYTHONPATH=SEAMS, PLAIT_TEST_SLOW_READ_S="0.05")
    try:
        load_s = wait_for_step(out, 3, nodes)
        i = nodes.node_of_rank(1 if node == "rank 1's" else 0)
        for c in children(nodes.procs[i].pid):
            os.kill(c, signal.SIGTERM)
        os.kill(nodes.procs[i].pid, signal.SIGTERM)
        took = wait_until(lambda: not ranks_alive(nodes), 600, "a rank did not stop")
    finally:
        nodes.stop()
    text = nodes.output(0) + nodes.output(1)
    status = json.loads((out / "exit_status.json").read_text())
    assert status["reason"] == "signal" and status["exit_code"] == 0 and took < 30 + load_s, (status, took, load_s, text[-3000:])
    (saved,) = committed(out / "checkpoints")
    assert saved.name == f"step_{status['step']:09d}" and verify(saved)["step"] == status["step"]
    assert sorted(p.name for p in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert "plait: error" not in text, text[-3000:]  # (torchrun prints a traceback of its own SignalException)


@pytest.mark.bench
def test_a_frozen_node_that_served_the_store_ends_the_survivor_through_its_watchdog(tmp_path):
    """Rank 0's node stops answering without closing a connection (SIGSTOP: a machine frozen or cut
    off, where SIGKILL lets the kernel close them). The survivor waits in a collective; its stall
    watchdog ends it after train.stall_timeout_s, and its line says that the rendezvous store, served
    from the frozen node, did not answer. (Its torchrun agent, whose rendezvous store the frozen node
    serves too, may not end by itself: launchers/k8s/entrypoint.sh ends it after AGENT_GRACE_S.)"""
    from core.checkpoint.folders import committed, verify

    cfg = write_tiny_config(tmp_path, steps=1000, global_batch_tokens=512)
    out = tmp_path / "out"
    args = ["--config", str(cfg), "--checkpoint.every=2", "--train.stall_timeout_s=6", "--train.collective_timeout_s=60"]
    nodes = Nodes(tmp_path, args, PYTHONPATH=SEAMS, PLAIT_TEST_SLOW_READ_S="0.05")
    frozen: list[int] = []
    try:
        load_s = wait_for_step(out, 3, nodes)
        lost = nodes.node_of_rank(0)
        frozen = [*children(nodes.procs[lost].pid), nodes.procs[lost].pid]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        survivor = [c for c in children(nodes.procs[1 - lost].pid) if rank_of(c) == 1]
        took = wait_until(lambda: not any(running(p) for p in survivor), 600, "the survivor's rank did not end")
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
        nodes.stop()
    text = nodes.output(1 - lost)
    (line,) = [line for line in text.splitlines() if line.startswith("plait: error: rank 1: stalled: no progress for")]
    assert took < 6 + 20 + load_s and "the rendezvous store at " in line and "did not answer (it is served from rank 0's node" in line, (took, line)
    assert all(verify(p)["step"] == int(p.name[5:]) for p in committed(out / "checkpoints"))


@pytest.mark.bench
def test_a_two_node_run_resumes_as_one_node_of_two_processes_and_back(tmp_path):
    """The same world size on another layout: two nodes of one process, ended by a crash at step 3;
    then one node of two processes (torchrun --standalone), ended by a crash at step 5; then two
    nodes again, to the end. Each start resumes from the last checkpoint of the one before, and the
    losses equal those of an uninterrupted run on one node, bitwise."""
    cfg = write_tiny_config(tmp_path, steps=6, global_batch_tokens=512)
    out, whole = tmp_path / "out", tmp_path / "whole"
    args = ["--config", str(cfg), "--checkpoint.every=2"]

    def one_node(*more: str, **extra: str) -> subprocess.CompletedProcess:
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "core.train", *args, *more]
        return subprocess.run(cmd, cwd=REPO, env=env(**extra), capture_output=True, text=True, timeout=120)

    for layout, crash_at, resumed in [("two nodes", "3", None), ("one node", "5", 2), ("two nodes", "", 4)]:
        seams = {"PYTHONPATH": SEAMS, "PLAIT_TEST_CRASH_AT_STEP": crash_at} if crash_at else {}
        if layout == "two nodes":
            nodes = Nodes(tmp_path, args, **seams)
            try:
                codes = nodes.wait([0, 1], timeout=120)
            finally:
                nodes.stop()
            text = nodes.output(0) + nodes.output(1)
        else:
            proc = one_node(**seams)
            codes, text = [proc.returncode], proc.stdout + proc.stderr
        assert (0 not in codes) if crash_at else codes == [0, 0], (layout, codes, text[-3000:])
        if resumed is not None:
            assert f"at step {resumed} (saved on 2 ranks, now 2)" in text, text[-3000:]
    assert one_node(f"--train.output_dir={whole}").returncode == 0
    got = [(r["step"], r["loss"]) for r in read_metrics(out)]
    assert got == [(r["step"], r["loss"]) for r in read_metrics(whole)], got
