"""``python -m core.train --config F [--section.key=value ...]``

Runs on one process, or on many under ``torchrun``; gloo on CPU and nccl on
CUDA, picked from the device. Bad input exits with code 2 before any process
group or model is built.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

from core.contract.errors import EXIT_BAD_INPUT, ArgumentParser, PlaitError, exit_bad_input


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = ArgumentParser(prog="python -m core.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run TOML file")
    return parser.parse_known_args(argv)


def record_bad_input(err: PlaitError, output_dir: str | None) -> None:
    """Under torchrun, ``<output_dir>/exit_status.json`` with exit code 2 (when that folder
    exists), so that a launcher that sees only torchrun's exit code (1 for any failed child)
    never retries bad input. Best effort: the folder itself may be the bad input. Never into the
    folder of a job that runs there (its launcher would take its later death for bad input)."""
    from core.runtime import watchdog
    from core.runtime.ownership import held_elsewhere

    if not output_dir or not os.environ.get("TORCHELASTIC_RUN_ID") or held_elsewhere(output_dir):
        return
    try:
        out = Path(output_dir)
        if not out.is_dir():
            return
        tmp = out / f"exit_status.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"exit_code": EXIT_BAD_INPUT, "reason": "bad_input", "step": 0, "detail": str(err)}) + "\n")
        os.replace(tmp, out / "exit_status.json")
        watchdog.end_recorded("bad_input")  # a hang in teardown from here on keeps it
    except OSError:
        pass


def output_dir_of(config: str, overrides: list[str]) -> str | None:
    """train.output_dir of a config that failed to prepare, when it can be read at all."""
    try:
        from core.config import files as config_io

        value = config_io.load(config, overrides).get("train", {}).get("output_dir", "runs/default")
        return value if isinstance(value, str) else None
    except (PlaitError, OSError, ValueError, RecursionError):
        return None


class LosableStream:
    """stdout or stderr for a run that must outlive its console. A launcher's ``tee`` killed by the
    signal that stops the run (Ctrl-C reaches the whole process group), a closed terminal or a
    closed pipe make every later write fail (BrokenPipeError, EIO); the run's own lines would then
    turn its clean stop into a crash, or a monitor's print into a failed checkpoint save. The first
    failed write drops this stream's output for the rest of the process; nothing is raised."""

    def __init__(self, stream) -> None:
        self.stream, self.lost = stream, False

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self.stream.write(text)
            except OSError:
                self.lost = True
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self.stream.flush()
            except OSError:
                self.lost = True

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    from core.runtime import ownership

    ownership.die_with_launcher()  # a rank never trains (or writes) on after its launcher is gone
    try:
        from core.preflight.prepare import prepare
        from core.runtime.distributed import env_world

        prep = prepare(args.config, overrides, lock=env_world()[0] == 0)  # one writer per run folder (the ranks follow rank 0's list)
    except PlaitError as e:
        if not isinstance(e, ownership.FolderInUse):  # that folder's exit_status.json is its running job's
            record_bad_input(e, output_dir_of(args.config, overrides))
        exit_bad_input(e)

    from core.checkpoint import SaveFailed
    from core.loop.trainer import Trainer
    from core.preflight import run_files
    from core.runtime import distributed, watchdog

    info = distributed.init(prep.rc.train.device, prep.rc.train.collective_timeout_s, prep.tensor_parallel, prep.pipeline_parallel)
    trainer = None

    def write_stall_status(code: int, reason: str, step: int, detail: str) -> None:
        if info.is_main:
            run_files.write_exit_status(Path(prep.rc.train.output_dir), code, reason, step, detail, strict=False)

    watchdog.start(
        prep.rc.train.stall_timeout_s, write_stall_status, "starting (building the model, resuming from a checkpoint)", info.rank, info.world_size
    )  # from here to the process's exit (run_and_exit), teardown included
    try:
        trainer = Trainer(prep, info)
        trainer.signals.install()
        trainer.build()
        failed = run_files.write_run_info(prep, info, trainer.versions)  # rank 0's; every rank stops with it
        if trainer.control.agree(int(failed is not None), "max"):
            return run_files.start_failed(trainer.output_dir, failed, trainer.run.step)
        if info.is_main:
            print(run_files.summary(prep, info, trainer.model, trainer.run), flush=True)
        return trainer.fit()
    except SaveFailed as e:  # raised on every rank together: a one-line error and exit code 74
        assert trainer is not None  # SaveFailed comes from fit()
        return trainer.save_failed(e)
    except PlaitError as e:
        if trainer is not None:  # found once the run exists (a plugin's answer, a monitor's run.state): monitors hear of it
            trainer.fail(e)  # and rank 0 records it (exit 2, bad_input) with the step
        elif info.is_main:
            record_bad_input(e, prep.rc.train.output_dir)
        exit_bad_input(e)  # SystemExit(2); the cleanup below still runs
    except (Exception, KeyboardInterrupt) as e:  # monitors hear of it (train_end "error"), launchers read exit_status.json
        from core.loop.lost_peer import explain

        # another rank gone (a lost node): one line on every rank that sees it, rank 0's in exit_status.json
        lost = explain(e, info.rank, watchdog.doing(), prep.checkpoint_root, prep.rc.train.collective_timeout_s)
        if trainer is not None:
            trainer.fail(lost or e)
        if lost is None:
            raise
        from core.contract import log

        log.error(str(lost), all_ranks=True)
        raise lost from e
    finally:
        # Free the model, optimizer and sharding state (they hold process groups, and the trainer
        # has reference cycles) while the interpreter is fully alive, then destroy the groups: a
        # gloo group left to interpreter finalization can abort the process after a good run.
        watchdog.progress("after the run's end: freeing the model, the optimizer and their process groups")
        trainer = None
        gc.collect()
        watchdog.progress("after the run's end: destroying the process groups (destroy_process_group)")
        distributed.shutdown()


def run_and_exit(argv: list[str] | None = None) -> None:
    """``main(argv)``, then leave without interpreter finalization. Everything the run writes is
    flushed and closed by then (checkpoints committed, monitors closed, exit_status.json written);
    what finalization would still tear down (gloo and DCP threads) can abort a finished rank with
    "terminate called without an active exception" (SIGABRT) once in a while, turning a good
    run into a failed one for torchrun. An exception still ends the process the normal way."""
    import os

    from core.runtime import ownership, watchdog

    sys.stdout, sys.stderr = LosableStream(sys.stdout), LosableStream(sys.stderr)  # type: ignore[assignment]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # a crash: its traceback goes to torchrun's summary too, then Python ends the process
        import traceback

        from core.contract.errors import tell_torchrun

        tell_torchrun(f"{type(e).__name__}: {e}", traceback.format_exc())
        ownership.release_run_folders(ended=True)  # this process writes nothing more there
        watchdog.progress("after a crash: Python's exit (joining threads, exit handlers)")
        raise
    from core.data.indexed import _shut_down_workers

    ownership.release_run_folders(ended=True)  # a clean end: a job on another host need not watch the lock

    watchdog.progress("after the run's end: stopping the data loaders' worker processes")
    _shut_down_workers()  # loader worker processes (atexit handlers do not run after os._exit)
    watchdog.progress("after the run's end: flushing stdout and stderr")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    run_and_exit()
