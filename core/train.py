"""``python -m core.train --config F [--section.key=value ...]``

Runs on one process, or on many under ``torchrun``; gloo on CPU and nccl on
CUDA, picked from the device. Bad input exits with code 2 before any process
group or model is built.
"""

from __future__ import annotations

import argparse
import sys

from core.errors import PlaitError, exit_bad_input


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m core.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="run TOML file")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        from core.prepare import prepare

        prep = prepare(args.config, overrides)
    except PlaitError as e:
        exit_bad_input(e)

    from core import distributed
    from core.trainer import Trainer

    info = distributed.init(prep.rc.train.device)
    try:
        trainer = Trainer(prep, info)
        trainer.install_signal_handlers()
        trainer.build()
        trainer.write_run_files()
        code = trainer.fit()
    except PlaitError as e:
        distributed.shutdown()
        exit_bad_input(e)
    finally:
        distributed.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
