"""plait's commands in processes forked from interpreters that have already imported torch.

A fresh ``python -m core.train`` spends about three CPU seconds of this 2-core machine importing
torch, its compiler front end (which ``torch.optim`` loads) and DTensor before plait runs a line;
the suite starts some hundreds of them. Here a *warm interpreter* (one per pytest worker and rank
slot, started on first use) imports those once, then forks one process per command. Each is a real
process with its own pid, process group, working directory, environment, stdout/stderr files and
exit code, running the module as ``python -m`` does (``runpy``, ``sys.argv``, ``PYTHONPATH`` entries
first on ``sys.path`` and a ``sitecustomize`` there imported first, as the test seams are; thread
joins and exit handlers at its end). Each warm interpreter forks, on first use, a *plait warm
interpreter* that has imported plait's own modules too (no plait module reads the environment, the
working directory or ``sys.argv`` when it loads): a command forks from that one unless the test seams
are on its ``PYTHONPATH`` (they patch plait before it loads, and a module that has loaded keeps what
it imported) or another plait package would be found first (:func:`plait_is_shared`).

The ranks of a job rendezvous as torchrun's do: each gets torchrun's variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ...) and connects to a ``TCPStore`` that
this process hosts (``TORCHELASTIC_USE_AGENT_STORE``). Rank r forks from slot r's interpreter, so
the ranks of a job hash strings differently, as separate interpreters do. As with torchrun, the
first rank to fail has the others stopped (SIGTERM, then SIGKILL after 30 s), and the job's exit
code is 1 when any rank failed.

Not for: the launchers themselves (their tests run real ``torchrun`` and ``plait train --nproc``),
a command that must start without torch, or another ``OMP_NUM_THREADS``: :func:`can_run` sends
those to a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import BinaryIO

PRELOADED = (
    "torch",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "numpy",
    "tensorboard.summary.writer.record_writer",
    "tensorboard.compat.proto.event_pb2",
)
"""What every warm interpreter imports: torch and the third-party modules a run loads."""

PLAIT_PACKAGES = ("core", "plugins", "model_specs")
NOT_PRELOADED = ("core.cli.lm_eval_model",)
"""plait modules a plait warm interpreter leaves to the command: this one imports lm-eval (and
registers plait's model with it), which a plait command loads only when asked to."""


def plait_modules() -> list[str]:
    """What a plait warm interpreter imports besides :data:`PRELOADED`: every module of plait's
    packages but :data:`NOT_PRELOADED` (a plugin package imports its modules only when plait
    registers it, so importing the packages alone would leave most of a run's imports to it)."""
    import importlib
    import pkgutil

    names = []
    for package in PLAIT_PACKAGES:
        root = importlib.import_module(package)
        names += [package, *(m.name for m in pkgutil.walk_packages(root.__path__, f"{package}.") if m.name not in NOT_PRELOADED)]
    return names


def plait_is_shared(env: dict[str, str], cwd: Path) -> bool:
    """Whether a command with ``env`` in ``cwd`` imports plait as a plait warm interpreter has:
    the installed packages, with no ``sitecustomize`` (the test seams) on ``PYTHONPATH`` to patch
    them before they load, and no other ``core``, ``plugins`` or ``model_specs`` package in the
    working directory or on ``PYTHONPATH`` to be found first. Otherwise the command forks from an
    interpreter that has imported torch alone and loads plait itself."""
    installed = Path(__file__).resolve().parents[1]
    extra = [Path(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if any((p / "sitecustomize.py").exists() for p in extra):
        return False
    return not any(p.resolve() != installed and any((p / name).exists() for name in PLAIT_PACKAGES) for p in [Path(cwd), *extra])


def can_run(module: str, env: dict[str, str], base: dict[str, str]) -> bool:
    """Whether ``python -m module`` with ``env`` behaves the same forked from a warm interpreter
    started with ``base``: a plait command (``core.*``) whose environment changes nothing read at
    interpreter start."""
    return module.startswith("core.") and same_start(env, base)


def same_start(env: dict[str, str], base: dict[str, str]) -> bool:
    """Whether a process with ``env`` starts as the warm interpreter started with ``base`` did: none
    of the variables read at interpreter start (or when torch loads) differ."""
    if os.environ.get("PLAIT_TEST_FRESH_INTERPRETERS"):
        return False
    read_at_start = {"OMP_NUM_THREADS", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE"}
    # torch's own settings (TORCHDYNAMO_*, TORCHINDUCTOR_*, TORCH_LOGS, ...) are read when torch loads
    read_at_start |= {k for k in {*env, *base} if k.startswith("TORCH") and not k.startswith("TORCHELASTIC_")}
    return all(env.get(k) == base.get(k) for k in read_at_start)


# --- the warm interpreter ------------------------------------------------------------------------


def _serve() -> None:  # pragma: no cover  (runs in the warm interpreter)
    import gc
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    # The preloaded modules' objects live as long as the process: keep them out of every collection
    # a command makes (each full collection would otherwise walk torch's million objects, and touch
    # the pages it shares with the warm interpreter).
    gc.collect()
    gc.freeze()
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    plait: tuple[int, BinaryIO, BinaryIO] | None = None  # the plait warm interpreter, once forked: pid, pipes
    replies = sys.stdout.buffer
    for line in sys.stdin.buffer:
        req = json.loads(line)
        if req.get("plait"):
            if plait is None:
                plait = _fork_plait_server(base_path)
            _, to_it, from_it = plait
            try:
                to_it.write(line)
                to_it.flush()
                answer = from_it.readline()
            except BrokenPipeError:
                answer = b""
            if not answer:
                break  # the plait warm interpreter ended: so does this one, and the test side starts them again
            replies.write(answer)
        else:
            replies.write(json.dumps(_answer(req, base_path)).encode() + b"\n")
        replies.flush()
    if plait is not None:  # its request pipe closed, it ends; waited for, its CPU time is this process's children's
        with contextlib.suppress(BrokenPipeError):
            plait[1].close()
        os.waitpid(plait[0], 0)


def _fork_plait_server(base_path: list[str]) -> tuple[int, BinaryIO, BinaryIO]:  # pragma: no cover  (warm interpreter)
    """Fork the plait warm interpreter: this one's child, with plait's modules imported too, serving
    the requests this one passes on through a pair of pipes until the first of them closes."""
    import gc
    import importlib

    requests, to_it = os.pipe()
    from_it, replies = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(to_it)
            os.close(from_it)
            _PIPES[:] = [requests, replies]  # no command it forks holds them
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)  # the test's pipes stay with the warm interpreter, which answers on them
            os.dup2(devnull, 1)
            for name in plait_modules():
                importlib.import_module(name)
            gc.collect()
            gc.freeze()
            out = os.fdopen(replies, "wb")
            for line in os.fdopen(requests, "rb"):
                out.write(json.dumps(_answer(json.loads(line), base_path)).encode() + b"\n")
                out.flush()
        except BaseException:
            import traceback

            traceback.print_exc()  # to the test's stderr; the warm interpreter ends on the closed pipe
        finally:
            os._exit(0)
    os.close(requests)
    os.close(replies)
    _PIPES[:] = [to_it, from_it]
    return pid, os.fdopen(to_it, "wb"), os.fdopen(from_it, "rb")


_PIPES: list[int] = []
"""The file descriptors of the pipes between a warm interpreter and its plait warm interpreter, which a
forked command closes: only the two interpreters hold them, so either sees the other end."""


def _answer(req: dict, base_path: list[str]) -> dict:  # pragma: no cover  (warm interpreter)
    """``start``: fork the command, answer its pid; ``poll``: its exit code once it has ended."""
    if req["op"] == "start":
        pid = os.fork()
        if pid == 0:
            _child(req, base_path)
        try:  # the child sets it too: whichever runs first, it leads its group before the pid is answered
            os.setpgid(pid, pid)
        except OSError:
            pass  # already ended, or already in its group
        return {"pid": pid}
    try:
        done, status = os.waitpid(req["pid"], os.WNOHANG)
        return {"code": os.waitstatus_to_exitcode(status) if done else None}
    except ChildProcessError:
        return {"code": None, "gone": True}


def _child(req: dict, base_path: list[str]) -> None:  # pragma: no cover  (runs in the fork)
    import atexit
    import importlib
    import runpy
    import traceback

    code = 1
    try:
        for fd in _PIPES:
            os.close(fd)
        os.setpgid(0, 0)
        if req.get("address_space"):
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (req["address_space"], req["address_space"]))
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.close(devnull)
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        script = req.get("script")  # ``python script.py``: the script's folder is first on sys.path, not the cwd
        sys.path[:] = [os.path.dirname(os.path.abspath(script)) if script else req["cwd"], *extra, *base_path]
        if any(os.path.exists(os.path.join(p, "sitecustomize.py")) for p in extra):
            sys.modules.pop("sitecustomize", None)  # as at interpreter start: the first on sys.path, before the command
            importlib.import_module("sitecustomize")
        try:
            if script:
                sys.argv = [script, *req["args"]]
                runpy.run_path(script, run_name="__main__")
            else:
                sys.argv = ["-m", *req["args"]]
                _unload(req["module"])
                runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as Python's exit does: join non-daemon threads,
        atexit._run_exitfuncs()  # then the exit handlers
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _unload(name: str) -> None:  # pragma: no cover  (runs in the fork)
    """Forget module ``name`` where a plait warm interpreter imported it: ``python -m name`` runs it as
    ``__main__`` and finds it neither in ``sys.modules`` nor on its package."""
    module = sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if module is not None and parent in sys.modules and getattr(sys.modules[parent], child, None) is module:
        delattr(sys.modules[parent], child)


# --- this side ---------------------------------------------------------------------------------


class WarmInterpreterEnded(RuntimeError):
    """A warm interpreter ended before it answered: killed, or its plait warm interpreter ended."""


class WarmInterpreter:
    """One warm interpreter and the pipe to it; started with ``base`` as its environment. A request
    with ``"plait": true`` goes on to its plait warm interpreter (forked on first use)."""

    def __init__(self, base: dict[str, str]) -> None:
        env = {k: v for k, v in base.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=Path(__file__).parent)
        self.lock = threading.Lock()

    def ask(self, req: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise WarmInterpreterEnded(f"the warm interpreter ended (exit code {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


_slots: dict[int, WarmInterpreter] = {}


def _slot(rank: int, base: dict[str, str]) -> WarmInterpreter:
    warm = _slots.get(rank)
    if warm is None or warm.proc.poll() is not None:
        warm = _slots[rank] = WarmInterpreter(base)
    return warm


def _fork(rank: int, base: dict[str, str], req: dict) -> tuple[WarmInterpreter, int]:
    """Fork ``req``'s command from slot ``rank``'s warm interpreter: the interpreter and the command's
    pid. A warm interpreter that has ended (killed, or its plait warm interpreter was) is started again."""
    warm = _slot(rank, base)
    try:
        return warm, warm.ask(req)["pid"]
    except WarmInterpreterEnded:
        warm.proc.wait(timeout=30)
        warm = _slot(rank, base)
        return warm, warm.ask(req)["pid"]


def close_all() -> None:
    while _slots:
        _slots.popitem()[1].close()


def run(
    module: str,
    args: list[str],
    *,
    nproc: int,
    env: dict[str, str],
    base: dict[str, str],
    cwd: Path,
    timeout: float,
    address_space: int | None = None,
    script: Path | None = None,
) -> subprocess.CompletedProcess:
    """``python -m module *args`` (``nproc`` > 1: as a job of that many ranks) in forked processes:
    stdout and stderr of all ranks together, as torchrun's are; the exit code of the one process, or
    of a job 0 when every rank ended 0 and 1 otherwise. ``address_space``: each process's
    ``RLIMIT_AS`` in bytes. ``script``: ``python script *args`` instead of the module."""
    store = None
    envs = [dict(env)]
    if nproc > 1:
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
        run_id = uuid.uuid4().hex[:12]
        envs = [
            {
                **env,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "GROUP_RANK": "0",
                "ROLE_RANK": str(r),
                "ROLE_NAME": "default",
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_WORLD_SIZE": "1",
                "ROLE_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": run_id,
                "TORCHELASTIC_USE_AGENT_STORE": "True",
            }
            for r in range(nproc)
        ]
    with tempfile.TemporaryDirectory(prefix="plait_cmd_") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        started = []
        plait = plait_is_shared(env, script.parent if script else cwd)  # sys.path[0]: the script's folder or the cwd
        for r, rank_env in enumerate(envs):
            req = {
                "op": "start",
                "plait": plait,
                "module": module,
                "args": list(args),
                "env": rank_env,
                "cwd": str(cwd),
                "stdout": str(out),
                "stderr": str(err),
                "address_space": address_space,
                "script": str(script) if script else None,
            }
            warm, pid = _fork(r, base, req)
            started.append((warm, pid, plait))
        command = [sys.executable, str(script)] if script else [sys.executable, "-m", module]
        codes = _wait(started, timeout, [*command, *args])
        del store
        stdout = out.read_text(errors="replace") if out.exists() else ""
        stderr = err.read_text(errors="replace") if err.exists() else ""
    code = codes[0] if nproc == 1 else (0 if all(c == 0 for c in codes) else 1)
    return subprocess.CompletedProcess([*command, *args], code, stdout, stderr)


class Process:
    """A command forked from a warm interpreter that runs on while the test acts on it, with the part
    of :class:`subprocess.Popen` the tests use: ``pid`` (also its process group's id), ``returncode``,
    :meth:`poll`, :meth:`wait` and :meth:`communicate` (the text of its stdout and stderr files where
    they were asked for with ``subprocess.PIPE``)."""

    def __init__(
        self, warm: WarmInterpreter, pid: int, plait: bool, args: list[str], outputs: tuple[Path | None, Path | None], tmp: tempfile.TemporaryDirectory
    ) -> None:
        self.warm, self.pid, self.plait, self.args, self.outputs, self.tmp = warm, pid, plait, args, outputs, tmp
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            answer = self.warm.ask({"op": "poll", "pid": self.pid, "plait": self.plait})
            if answer.get("gone"):
                self.returncode = 1
            elif answer["code"] is not None:
                self.returncode = answer["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.01
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """SIGKILL to its process group, unless it has ended."""
        if self.poll() is None:
            _kill(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        self.wait(timeout)
        texts = tuple(path.read_text(errors="replace") if path is not None and path.exists() else ("" if path is not None else None) for path in self.outputs)
        self.tmp.cleanup()
        return texts  # type: ignore[return-value]


def start(module: str, args: list[str], *, env: dict[str, str], base: dict[str, str], cwd: Path, stdout: object, stderr: object) -> Process:
    """``python -m module *args`` forked from this worker's warm interpreter, returned at once.
    ``stdout``: ``subprocess.PIPE`` (:meth:`Process.communicate` returns it), ``subprocess.DEVNULL``
    or an open file; ``stderr``: the same, or ``subprocess.STDOUT``."""
    tmp = tempfile.TemporaryDirectory(prefix="plait_cmd_")

    def target(choice: object, name: str) -> tuple[str, Path | None]:
        if choice == subprocess.PIPE:
            return str(Path(tmp.name) / name), Path(tmp.name) / name
        if choice == subprocess.DEVNULL or choice is None:
            return os.devnull, None
        return str(Path(choice.name).resolve()), None  # type: ignore[attr-defined]  # an open file: its path

    out, out_text = target(stdout, "stdout")
    err, err_text = (out, None) if stderr == subprocess.STDOUT else target(stderr, "stderr")
    plait = plait_is_shared(env, cwd)
    req = {
        "op": "start",
        "plait": plait,
        "module": module,
        "args": list(args),
        "env": env,
        "cwd": str(cwd),
        "stdout": out,
        "stderr": err,
        "address_space": None,
    }
    warm, pid = _fork(0, base, req)
    return Process(warm, pid, plait, [sys.executable, "-m", module, *args], (out_text, err_text), tmp)


def _kill(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait(started: list[tuple[WarmInterpreter, int, bool]], timeout: float, cmd: list[str]) -> list[int]:
    codes: list[int | None] = [None] * len(started)
    deadline = time.monotonic() + timeout
    stopping_since: float | None = None
    pause = 0.01
    while any(c is None for c in codes):
        for i, (warm, pid, plait) in enumerate(started):
            if codes[i] is None:
                answer = warm.ask({"op": "poll", "pid": pid, "plait": plait})
                codes[i] = answer["code"] if not answer.get("gone") else 1
        running = [pid for (_, pid, _), c in zip(started, codes) if c is None]
        if not running:
            break
        now = time.monotonic()
        if now > deadline:
            for pid in running:
                _kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(cmd, timeout)
        if stopping_since is None and any(c not in (None, 0) for c in codes):
            stopping_since = now  # torchrun's rule: one rank failed, the job stops
            for pid in running:
                _kill(pid, signal.SIGTERM)
        elif stopping_since is not None and now - stopping_since > 30:
            for pid in running:
                _kill(pid, signal.SIGKILL)
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
    return [c if c is not None else 1 for c in codes]


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
