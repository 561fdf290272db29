"""``plait train --config F [--nproc N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT]] [--section.key=value ...]``

Without ``--nproc``: one process, exactly ``python -m core.train``. With it: the pre-flight checks
run once here, for the world size ``nproc x nnodes`` and with no process group (bad input: one line
``plait: error: ...``, exit code 2, no rank started), then torch's own elastic launcher
(``torch.distributed.run``, as ``torchrun``) starts the ranks of ``python -m core.train``. One
node by default (``--standalone``); on several, each node runs the same command with its own
``--node-rank`` and the first node's ``--rdzv-endpoint``.

Exit code: a rank's, as ``python -m core.train`` gives it (0 done, 2 bad input, 3 non-finite loss,
4 a monitor failed, 74 a save failed, 75/76 budget stops, 1 a crash) instead of torchrun's 1 for
any failed rank; the first rank to fail with a code of its own decides. A rank killed by signal S:
128 + S. This launcher stopped by a signal (forwarded to the ranks by torch's launcher): the code
rank 0 wrote to ``<output_dir>/exit_status.json`` for this start, else 128 + the signal.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from core.contract.errors import ArgumentParser, PlaitError, exit_bad_input


def parse_args(argv: list[str] | None):
    parser = ArgumentParser(prog="plait train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run TOML file")
    parser.add_argument("--nproc", type=int, metavar="N", help="ranks on this node, started by torch's elastic launcher (default: one process, no launcher)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="M", help="nodes in the run (default 1); needs --nproc")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's rank, 0..M-1 (default 0)")
    parser.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="node 0's address for the rendezvous (needed with --nnodes above 1)")
    args, overrides = parser.parse_known_args(argv)
    if args.nproc is None:
        if args.nnodes != 1 or args.node_rank != 0 or args.rdzv_endpoint:
            parser.error("--nnodes, --node-rank and --rdzv-endpoint need --nproc")
        return args, overrides
    if args.nproc < 1 or args.nnodes < 1:
        parser.error(f"--nproc and --nnodes: expected integers >= 1, got {args.nproc} and {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank: expected 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        parser.error("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
    if args.rdzv_endpoint is not None:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            parser.error(f"--rdzv-endpoint: expected HOST:PORT with a port 1..65535, got {args.rdzv_endpoint!r}")
    return args, overrides


def preflight(config: str, overrides: list[str], world_size: int, node_size: int | None = None) -> Path:
    """``core.plan``'s checks for this world size and ``node_size`` ranks per node (nothing is left
    behind, no folder is locked): the run's output folder, or bad input as a PlaitError."""
    from core.preflight.prepare import prepare
    from core.runtime.ownership import check_run_folders

    prep = prepare(config, overrides, world_size=world_size, dry_run=True, node_size=node_size)
    check_run_folders([prep.rc.train.output_dir, prep.checkpoint_root])  # a job writing there now
    return Path(prep.rc.train.output_dir)


def torchrun_argv(args: Any, overrides: list[str]) -> list[str]:
    """The ``torchrun`` command line (without ``torchrun``) that starts the ranks of ``core.train``."""
    where = ["--standalone"] if args.nnodes == 1 else ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank), "--rdzv-endpoint", args.rdzv_endpoint]
    return ["--nproc-per-node", str(args.nproc), *where, "-m", "core.train", "--config", args.config, *overrides]


def rank_exit_code(failures: dict[int, Any]) -> int:
    """The exit code of a failed start from its ranks' (torch's ``ProcessFailure.exitcode``, negative
    for a signal): the first rank to fail, by torch's timestamps, unless it was killed by a signal and
    another rank exited with a code of its own (the lowest such rank's)."""
    first = min(failures, key=lambda rank: failures[rank].timestamp)
    code = failures[first].exitcode
    if code < 0:
        own = [rank for rank in sorted(failures) if failures[rank].exitcode > 0]
        code = failures[own[0]].exitcode if own else code
    return 128 - code if code < 0 else code


def recorded_exit_code(output_dir: Path, since: float) -> int | None:
    """``exit_code`` from ``<output_dir>/exit_status.json`` when rank 0 wrote it after ``since``."""
    path = output_dir / "exit_status.json"
    try:
        if path.stat().st_mtime < since:
            return None
        code = json.loads(path.read_text()).get("exit_code")
    except (OSError, ValueError, AttributeError):
        return None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def launch(args: Any, overrides: list[str], output_dir: Path) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_args
    from torch.distributed.run import run

    started = time.time()
    try:
        run(torchrun_args(torchrun_argv(args, overrides)))
    except ChildFailedError as e:
        return rank_exit_code(e.failures)
    except SignalException as e:
        code = recorded_exit_code(output_dir, started)
        return 128 + int(e.sigval) if code is None else code
    return 0


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    if args.nproc is None:
        from core.cli.train import run_and_exit

        run_and_exit(["--config", args.config, *overrides])  # leaves the process
    try:
        output_dir = preflight(args.config, overrides, args.nproc * args.nnodes, node_size=args.nproc)
    except PlaitError as e:
        exit_bad_input(e)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for several ranks, without its banner
    return launch(args, overrides, output_dir)
