"""``python -m core.train --config F [--section.key=value ...]``

Runs on one process, or on many under ``torchrun``; gloo on CPU and nccl on
CUDA, picked from the device. Bad input exits with code 2 before any process
group or model is built.
"""

from __future__ import annotations

import argparse
import gc
import sys

from core.errors import PlaitError, exit_bad_input


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m core.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run TOML file")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    from core import ownership

    ownership.die_with_launcher()  # a rank never trains (or writes) on after its launcher is gone
    try:
        from core.distributed import env_world
        from core.prepare import prepare

        prep = prepare(args.config, overrides)
        if env_world()[0] == 0:  # one writer per run folder, held until this process ends
            ownership.lock_run_folders([prep.rc.train.output_dir, prep.checkpoint_root])
    except PlaitError as e:
        exit_bad_input(e)

    from core import distributed
    from core.checkpoint import SaveFailed
    from core.trainer import Trainer

    info = distributed.init(prep.rc.train.device)
    trainer = None
    try:
        trainer = Trainer(prep, info)
        trainer.install_signal_handlers()
        trainer.build()
        trainer.write_run_files()
        return trainer.fit()
    except SaveFailed as e:  # raised on every rank together: a one-line error and exit code 74
        return trainer.save_failed(e)
    except PlaitError as e:
        exit_bad_input(e)  # SystemExit(2); the cleanup below still runs
    except (Exception, KeyboardInterrupt) as e:  # monitors hear of it (train_end "error"), launchers read exit_status.json
        if trainer is not None:
            trainer.fail(e)
        raise
    finally:
        # Free the model, optimizer and sharding state (they hold process groups, and the trainer
        # has reference cycles) while the interpreter is fully alive, then destroy the groups: a
        # gloo group left to interpreter finalization can abort the process after a good run.
        trainer = None
        gc.collect()
        distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
