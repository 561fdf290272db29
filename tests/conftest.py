"""Shared test helpers: run plait's commands as real subprocesses (torchrun included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import prestarted
import pytest

from bench.common import free_port  # noqa: F401  (for the tests: a port outside the ephemeral range)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable

# torch.compile in a test (this process, and every process it starts, which inherit the variable)
# compiles its kernels in that process: with the default, each compiling process first starts a
# pool of fresh interpreters that import torch, and the suite already keeps every core busy.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# The suite starts some hundreds of interpreters: the first to import a module writes its bytecode
# and the rest read it. The README installs without compiling (pip's --no-compile), so only what the
# suite imports is ever compiled; with PYTHONDONTWRITEBYTECODE set (this machine and its CI set it)
# every interpreter would compile torch and plait from source instead.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    e["PYTHONUNBUFFERED"] = "1"
    e.update(extra)
    return e


def run_module(
    module: str, *args: str, timeout: float = 300, cwd: Path = REPO, extra_env: dict | None = None, address_space: int | None = None
) -> subprocess.CompletedProcess:
    """``python -m module *args``: a plait command in a process forked from a warm interpreter
    (:mod:`prestarted`) where that behaves the same, otherwise in a fresh one. ``address_space``:
    the process's ``RLIMIT_AS`` in bytes (a read that would take the machine's memory fails instead)."""
    full = env(**(extra_env or {}))
    if prestarted.can_run(module, full, env()):
        return prestarted.run(module, list(args), nproc=1, env=full, base=env(), cwd=Path(cwd), timeout=timeout, address_space=address_space)

    def limit() -> None:
        import resource

        if address_space:
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    return subprocess.run([PY, "-m", module, *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout, preexec_fn=limit)


def start_module(module: str, *args: str, cwd: Path = REPO, extra_env: dict | None = None, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """``python -m module *args`` started and returned at once, for a test that acts on it while it
    runs (signals, kills, a second job beside it): forked from a warm interpreter (:mod:`prestarted`)
    where that behaves the same, otherwise a fresh one; its own process group either way, so
    ``os.killpg(proc.pid, ...)`` reaches it and its children. ``stdout``/``stderr`` as for
    :class:`subprocess.Popen` (PIPE, DEVNULL, an open file, STDOUT); read PIPEs with ``communicate``."""
    full = env(**(extra_env or {}))
    if prestarted.can_run(module, full, env()):
        return prestarted.start(module, list(args), env=full, base=env(), cwd=Path(cwd), stdout=stdout, stderr=stderr)
    return subprocess.Popen([PY, "-m", module, *args], cwd=cwd, env=full, stdout=stdout, stderr=stderr, text=True, start_new_session=True)


def torchrun_argv(nproc: int, *args: str, script: Path | None = None) -> list[str]:
    """The command line of a local torchrun job: ``core.train`` (or ``script``) with ``args``. Its store
    binds a port the kernel picks (``--standalone``), so parallel jobs never race for one."""
    target = [str(script)] if script is not None else ["-m", "core.train"]
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target, *args]


def torchrun(nproc: int, *args: str, timeout: float = 300, extra_env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """A job of ``nproc`` ranks of ``core.train``: forked from warm interpreters with torchrun's
    variables and store (:mod:`prestarted`) where that behaves the same, otherwise real torchrun."""
    full = env(**(extra_env or {}))
    if prestarted.can_run("core.train", full, env()):
        return prestarted.run("core.train", list(args), nproc=nproc, env=full, base=env(), cwd=Path(cwd), timeout=timeout)
    return real_torchrun(nproc, *args, timeout=timeout, extra_env=extra_env, cwd=cwd)


def torchrun_script(nproc: int, script: Path, *args: str, timeout: float = 300, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """A job of ``nproc`` ranks of ``python script *args`` (a test's worker script using plait's
    internals under torch.distributed): forked from warm interpreters with torchrun's variables and
    store (:mod:`prestarted`) where that behaves the same, otherwise real torchrun."""
    full = env(**(extra_env or {}))
    if prestarted.same_start(full, env()):
        return prestarted.run("", list(args), nproc=nproc, env=full, base=env(), cwd=REPO, timeout=timeout, script=Path(script))
    return subprocess.run(torchrun_argv(nproc, *args, script=Path(script)), cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout)


def real_torchrun(nproc: int, *args: str, timeout: float = 300, extra_env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node=nproc -m core.train *args``."""
    cmd = torchrun_argv(nproc, *args)
    return subprocess.run(cmd, cwd=cwd, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=timeout)


def read_metrics(output_dir: Path, kind: str = "train") -> list[dict]:
    path = output_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind", "train") == kind]


def write_tiny_config(tmp_path: Path, name: str = "run.toml", body: str = "", **train) -> Path:
    """A small config for a fast CPU run in ``tmp_path`` (output in ``tmp_path/out``)."""
    out = tmp_path / "out"
    text = (
        f'''
extends = "{REPO / "train_configs" / "base.toml"}"
[train]
steps = {train.get("steps", 6)}
global_batch_tokens = {train.get("global_batch_tokens", 1024)}
micro_batch = {train.get("micro_batch", 2)}
output_dir = "{out}"
device = "cpu"
log_every = 1
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
[monitors]
enabled = ["console", "jsonl"]
'''
        + body
    )
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def tiny_config(tmp_path: Path):
    """Write a small config for a fast CPU run and return its path; kwargs become [train] values."""

    def make(name: str = "run.toml", body: str = "", **train) -> Path:
        return write_tiny_config(tmp_path, name, body, **train)

    return make


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one intra-op thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``): on two
    shared CPU cores intra-op threads only contend (a step of the tiny model takes ~1 ms on one)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def flat_checkpoint(path: Path) -> dict:
    """A DCP checkpoint folder as one nested dict of tensors ({"model": ..., "optimizer": ...}), read with
    DCP's own single-process converter and loaded with ``weights_only=True``."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = path.parent / f"{path.name}.flat.pt"
    dcp_to_torch_save(str(path), str(flat))
    try:
        return torch.load(flat, weights_only=True)
    finally:
        flat.unlink()


def in_a_small_disk(size: str, mountpoint: Path, script: str, extra_env: dict | None = None) -> subprocess.CompletedProcess | None:
    """``script`` (sh) run where ``mountpoint`` is a fresh tmpfs of ``size``, in a mount namespace of
    its own (root: ``unshare -m``; otherwise a user namespace, ``unshare -rm``); None where neither may mount."""
    for unshare in (["unshare", "-m"], ["unshare", "-rm"]):
        probe = subprocess.run([*unshare, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mountpoint)], capture_output=True)
        if probe.returncode == 0:
            inner = f'mount -t tmpfs -o size={size} tmpfs "{mountpoint}" && {script}'
            return subprocess.run([*unshare, "sh", "-c", inner], cwd=REPO, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=300)
    return None


def main_here(main, *args: str) -> tuple[int, str, str]:
    """A command's ``main(list(args))`` in this process, with no new interpreter (no second import of
    torch): (exit code, stdout, stderr). For what a command decides before it builds a process group
    or starts a thread (a run folder's lock lease), such as bad input (exit 2); a thread it leaves fails the test."""
    import io
    import threading
    from contextlib import redirect_stderr, redirect_stdout

    from core.contract import log

    threads = set(threading.enumerate())
    warned = set(log._warned)
    log._warned.clear()  # a command's once-per-process warnings, as in a process of its own
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            log._warned.clear()
            log._warned.update(warned)
    left = [t.name for t in set(threading.enumerate()) - threads]
    assert not left, f"{main.__module__}.main left threads running in the test process: {left}; run it as a process"
    return code, out.getvalue(), err.getvalue()


def run_here(module: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``run_module(module, *args)`` in this process (``core.<cmd>`` is ``core.cli.<cmd>``'s ``main``):
    the same exit code, stdout and stderr, without a new interpreter. For a command that refuses bad
    input or stops before it builds anything (see :func:`main_here`); ``cwd``: the working directory it runs in."""
    from importlib import import_module

    name = f"core.cli.{module[5:]}" if module.startswith("core.") and module.count(".") == 1 else module
    here = Path.cwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        code, out, err = main_here(import_module(name).main, *args)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess([module, *args], code, out, err)


def pytest_sessionfinish(session, exitstatus) -> None:
    """The warm interpreters of this pytest process end with it (:mod:`prestarted`)."""
    prestarted.close_all()
