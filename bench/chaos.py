"""Kill a real 2-rank training job at random moments, restart it, and count what was lost.

    python -m bench.chaos --trials 20 --seed 0 [--steps 24] [--every 4] [--json FILE]

A debug job (``torchrun --nproc_per_node=2 -m core.train`` on a tiny CPU llama3, gloo,
a checkpoint every ``--every`` steps, ``checkpoint.resume = "auto"``) is started in a session
of its own and, ``--trials`` times, killed at a random moment with one of

* ``sigkill``: SIGKILL to torchrun, its ranks and their children at once (a lost node);
* ``sigterm``: SIGTERM to torchrun and the ranks (a scheduler's pre-emption, as SLURM or a
  container runtime sends it to every process of the job);
* ``ctrl_c``:  SIGINT to the launcher's process group, as a terminal sends it (torch 2.13's
  torchrun starts each rank in a session of its own and forwards the signal to them).

After each kill it is started again with the same command, until it finishes; then the next
job starts in a fresh folder (every other job uses async saves), until all trials are spent
and the last job has finished. Reported: trials, resumes, steps lost (the furthest step a job
had logged minus the step its next start resumes from) and how many exceeded the checkpoint
interval, clean stops (SIGTERM/Ctrl-C after training began: ``exit_status.json`` with reason
``signal`` and a committed checkpoint at the step it stopped), unusable checkpoints (a
committed checkpoint that fails ``verify`` or a full DCP load), and whether each finished
job's final loss equals an uninterrupted run's, bitwise (same seed).

The kill schedule (kind, and the delay after the start or after the attempt's first logged
step) is drawn from ``--seed`` alone, so it is reproducible; where in a step a delay lands
depends on the machine's speed. Exit code 1 if a checkpoint was unusable, a final loss
differed or an attempt hung; else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import free_port

REPO = Path(__file__).resolve().parents[1]
KINDS = ("sigkill", "sigterm", "ctrl_c")
KILL = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "ctrl_c": signal.SIGINT}


def write_config(folder: Path, steps: int, every: int) -> Path:
    cfg = folder / "chaos.toml"
    cfg.write_text(f'''
extends = "{REPO / "train_configs" / "base.toml"}"
[train]
steps = {steps}
global_batch_tokens = 1024
micro_batch = 2
device = "cpu"
log_every = 1
seed = 1234
[model]
name = "llama3"
flavor = "debug"
dim = 64
n_layers = 2
[data]
name = "token_bin"
path = "{REPO / "plugins" / "data" / "corpus" / "shakespeare"}"
seq_len = 128
[precision]
name = "fp32"
[checkpoint]
every = {every}
keep_latest = 0
resume = "auto"
[monitors]
enabled = ["console", "jsonl"]
''')
    return cfg


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    got = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:  # a line cut by a kill
            continue
        if r.get("kind", "train") == "train" and "loss" in r:
            got.append(r)
    return got


def committed(out: Path) -> list[Path]:
    root = out / "checkpoints"
    return sorted(p for p in root.glob("step_*") if (p / "COMMITTED").is_file()) if root.is_dir() else []


def usable(path: Path) -> str:
    """'' if the committed checkpoint verifies and loads completely, else why not."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from core.checkpoint.folders import verify

    try:
        verify(path)
        sd: dict = {}
        _load_state_dict(sd, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        if not any(k.startswith("model") for k in sd):
            return "no model tensors"
        for r in (path / "rng").glob("*.json"):
            json.loads(r.read_text())
    except BaseException as e:  # noqa: BLE001 - DCP raises BaseExceptions
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return ""


class Job:
    def __init__(self, folder: Path, cfg: Path, async_save: bool, log) -> None:
        self.out, self.cfg, self.async_save, self.log = folder, cfg, async_save, log
        self.attempts = 0
        self.checked: dict[str, str] = {}

    def start(self) -> subprocess.Popen:
        self.attempts += 1
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "-m",
            "core.train",
            "--config",
            str(self.cfg),
            f"--train.output_dir={self.out}",
            f"--checkpoint.async={'true' if self.async_save else 'false'}",
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        (self.out / "exit_status.json").unlink(missing_ok=True)
        self.log.write(f"\n=== {self.out.name} attempt {self.attempts}\n")
        self.log.flush()
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def status(self) -> dict:
        try:
            return json.loads((self.out / "exit_status.json").read_text())
        except (OSError, ValueError):
            return {}

    def check_checkpoints(self) -> list[str]:
        """Newly committed checkpoints that fail to load (each checked once)."""
        bad = []
        for p in committed(self.out):
            key = f"{p.name}:{(p / 'COMMITTED').stat().st_mtime_ns}"
            if key not in self.checked:
                self.checked[key] = usable(p)
                if self.checked[key]:
                    bad.append(f"{p}: {self.checked[key]}")
        return bad


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun's ranks live in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for p in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents.get(p, [])
    return out


def send(proc: subprocess.Popen, kind: str) -> None:
    if kind == "ctrl_c":
        os.killpg(proc.pid, signal.SIGINT)
        return
    for p in tree(proc.pid):
        try:
            os.kill(p, KILL[kind])
        except OSError:
            pass


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_exit(proc: subprocess.Popen, timeout: float, members: list[int] | None = None) -> bool:
    """True if the launcher and its ranks (``members``, taken before any kill) ended by
    themselves within ``timeout``; else SIGKILL what is left."""
    members = members or tree(proc.pid)
    deadline = time.time() + timeout
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    while time.time() < deadline and any(alive(p) for p in members if p != proc.pid):
        time.sleep(0.1)
    hung = proc.poll() is None or any(alive(p) for p in members if p != proc.pid)
    for p in members:
        try:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    proc.wait()
    return not hung


def reference_loss(folder: Path, cfg: Path, log) -> tuple[float, float]:
    job = Job(folder / "reference", cfg, False, log)
    job.out.mkdir(parents=True)
    t0 = time.time()
    proc = job.start()
    if not wait_exit(proc, 900) or job.status().get("reason") != "completed":
        raise SystemExit(f"chaos: the uninterrupted reference run failed (log: {log.name})")
    return rows(job.out)[-1]["loss"], time.time() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="kills in all")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill schedule")
    ap.add_argument("--steps", type=int, default=24, help="steps of each job")
    ap.add_argument("--every", type=int, default=4, help="checkpoint.every")
    ap.add_argument("--window", type=float, default=3.0, help="kills land up to this many seconds after an attempt's first step")
    ap.add_argument("--startup-kills", type=float, default=0.15, help="share of kills during start-up (before the first step)")
    ap.add_argument("--workdir", default="", help="keep the jobs here (default: a temporary folder, removed)")
    ap.add_argument("--json", default="", help="write the figures here too")
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="plait_chaos_"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = write_config(work, args.steps, args.every)
    log = (work / "chaos.log").open("a")
    t_start = time.time()
    ref, ref_s = reference_loss(work, cfg, log)
    print(f"chaos: reference run: final loss {ref!r} after {args.steps} steps ({ref_s:.0f} s)", flush=True)

    kills: list[dict] = []
    jobs: list[dict] = []
    unusable: list[str] = []
    hung = 0
    job_no = 0
    while len(kills) < args.trials or (jobs and not jobs[-1]["finished"]):
        if not jobs or jobs[-1]["finished"]:
            job_no += 1
            folder = work / f"job_{job_no:02d}"
            folder.mkdir()
            jobs.append({"name": folder.name, "async": job_no % 2 == 0, "finished": False, "obj": Job(folder, cfg, job_no % 2 == 0, log)})
        job: Job = jobs[-1]["obj"]
        before = len(rows(job.out))
        proc = job.start()
        kill = None
        if len(kills) < args.trials:
            kill = {"trial": len(kills) + 1, "job": job.out.name, "async": job.async_save, "kind": rng.choice(KINDS)}
            if rng.random() < args.startup_kills:
                kill["when"], kill["delay_s"] = "startup", round(rng.uniform(0.5, 6.0), 3)
            else:
                kill["when"], kill["delay_s"] = "training", round(rng.uniform(0.0, args.window), 3)
            t0 = time.time()
            if kill["when"] == "training":  # from the attempt's first logged step
                while proc.poll() is None and len(rows(job.out)) <= before and time.time() - t0 < 300:
                    time.sleep(0.05)
            time.sleep(kill["delay_s"])
            members = tree(proc.pid)
            if proc.poll() is None:
                kill["step_logged"] = max([r["step"] for r in rows(job.out)], default=0)
                send(proc, kill["kind"])
            else:
                kill = None  # it finished first: this attempt was not killed
        else:
            members = None
        if not wait_exit(proc, 300 if kill is None else 120, members):
            hung += 1
        unusable += job.check_checkpoints()
        status = job.status()
        done = [int(p.name.split("_")[1]) for p in committed(job.out) if not job.checked.get(f"{p.name}:{(p / 'COMMITTED').stat().st_mtime_ns}")]
        resume_step = max(done, default=0)
        furthest = max([r["step"] for r in rows(job.out)], default=0)
        finished = status.get("reason") == "completed" and status.get("step") == args.steps
        if kill is not None:
            kill["rc"] = proc.returncode
            kill["status"] = status.get("reason", "")
            kill["resume_step"] = resume_step
            kill["lost"] = max(0, furthest - resume_step)
            kill["clean"] = (
                status.get("reason") in ("signal", "completed")  # completed: the kill came too late
                and status.get("step") == resume_step == furthest
            )
            kills.append(kill)
            print(
                f"chaos: trial {kill['trial']:>3} {job.out.name} {'async' if job.async_save else 'sync '} "
                f"{kill['kind']:<7} at {kill['when']}+{kill['delay_s']:.2f}s: logged step {kill.get('step_logged', 0)}, "
                f"exit {status.get('reason') or 'died'}, resumes at {resume_step}, lost {kill['lost']}",
                flush=True,
            )
        if finished:
            by_step = {r["step"]: r["loss"] for r in rows(job.out)}  # the last logged value of each step
            jobs[-1].update(finished=True, final=by_step[args.steps], equal=by_step[args.steps] == ref, attempts=job.attempts)
            print(
                f"chaos: {job.out.name} finished after {job.attempts} attempt(s): final loss {by_step[args.steps]!r} "
                f"{'==' if by_step[args.steps] == ref else '!='} reference",
                flush=True,
            )
        elif job.attempts > args.trials + 10:
            raise SystemExit(f"chaos: {job.out.name} does not finish (log: {work / 'chaos.log'})")

    signal_kills = [k for k in kills if k["kind"] != "sigkill" and k["when"] == "training"]
    lost = [k["lost"] for k in kills]
    figures = {
        "trials": len(kills),
        "by_kind": {kind: sum(k["kind"] == kind for k in kills) for kind in KINDS},
        "startup_kills": sum(k["when"] == "startup" for k in kills),
        "kills_after_completion": sum(k["status"] == "completed" for k in kills),  # landed as the job ended
        "jobs": len(jobs),
        "async_jobs": sum(j["async"] for j in jobs),
        "resumes": sum(j["attempts"] - 1 for j in jobs),
        "steps_lost_total": sum(lost),
        "steps_lost_max": max(lost, default=0),
        "checkpoint_every": args.every,
        "kills_losing_more_than_interval": sum(v > args.every for v in lost),
        "clean_signal_stops": f"{sum(k['clean'] for k in signal_kills)}/{len(signal_kills)}",
        "signal_kills_losing_steps": sum(k["lost"] > 0 for k in signal_kills),
        "checkpoints_checked": sum(len(j["obj"].checked) for j in jobs),
        "unusable_checkpoints": len(unusable),
        "final_loss_equal": f"{sum(j['equal'] for j in jobs)}/{len(jobs)}",
        "hung_attempts": hung,
        "wall_s": round(time.time() - t_start),
        "seed": args.seed,
        "steps": args.steps,
    }
    print("chaos: " + json.dumps(figures), flush=True)
    for u in unusable:
        print(f"chaos: unusable checkpoint {u}", flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"figures": figures, "kills": kills, "jobs": [{k: v for k, v in j.items() if k != "obj"} for j in jobs], "unusable": unusable}, indent=1)
            + "\n"
        )
    log.close()
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if unusable or hung or not all(j["equal"] for j in jobs) else 0


if __name__ == "__main__":
    sys.exit(main())
