"""How many of the repository's files one checkpoint save and one resume run code in.

A tiny single-process run (llama3 debug flavor, synthetic tokens, CPU) trains one step; then
``sys.setprofile`` (and ``threading.setprofile``, for DCP's writer threads) records every repository
file whose code is called during:

* a save: ``Checkpointer.save`` of a sync checkpoint, its commit and pruning included;
* a resume: the candidates listed (``Checkpointer.find_resume``), the first sound one agreed on
  (``CheckpointDir.first_sound``), the load (``Checkpointer.restore``) and the branch left
  (``Checkpointer.leave_branch``), into a freshly built state.

Prints the counts and, with ``--files``, the files.

    python -m bench.trace_checkpoint [--files] [--record]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent


def traced(action: Callable[[], Any]) -> set[str]:
    """The repository files whose code ``action`` calls (not the bench's own, nor a virtual environment's)."""
    seen: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            seen.add(frame.f_code.co_filename)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    mine = set()
    for name in seen:
        path = Path(name)
        if path.is_absolute() and path.is_relative_to(REPO) and path.relative_to(REPO).parts[0] not in ("bench", ".venv"):
            mine.add(str(path.relative_to(REPO)))
    return mine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", action="store_true", help="list the files, not only count them")
    p.add_argument("--record", action="store_true", help="append the counts to bench/results.jsonl")
    args = p.parse_args(argv)
    import torch

    from bench.common import synthetic_config
    from core.checkpoint import Checkpointer
    from core.contract.protocols import DistInfo
    from core.loop.trainer import Trainer
    from core.preflight.prepare import prepare

    tmp = Path(tempfile.mkdtemp(prefix="plait-trace-"))
    try:
        config = str(synthetic_config("debug", 32, 1, "cpu", str(tmp)))
        trainer = Trainer(prepare(config, ["--checkpoint.keep_latest=2", "--checkpoint.every=1"]), DistInfo(device=torch.device("cpu")))
        trainer.build()
        trainer.fit()  # one step, saved: the optimizer state exists; the first save of a process imports what later ones reuse
        trainer.run.step = 2  # as if one more step was made
        save = traced(lambda: trainer.checkpointer.save(2, use_async=False))

        prep = prepare(config, ["--checkpoint.resume=auto", "--checkpoint.keep_latest=2"])
        again = Trainer(prep, DistInfo(device=torch.device("cpu")))
        again.build()  # a fresh state (it resumes step 2 itself: the bench resumes it once more, traced)
        where, opts, root, meta, arch = again.checkpointer.where, prep.rc.sections["checkpoint"], prep.checkpoint_root, prep.model_meta, prep.architecture

        def resume() -> None:
            candidates = Checkpointer.find_resume(opts, root, meta, arch)
            path, rest = where.first_sound(candidates, meta, arch)
            assert path is not None and again.checkpointer.restore(path, last=not rest), "the resume failed"
            again.checkpointer.leave_branch(path)

        loaded = traced(resume)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = "| traced | repository files | in core/checkpoint/ |\n|---|---|---|\n"
    for what, files in (("save", save), ("resume", loaded)):
        table += f"| {what} | {len(files)} | {sum(f.startswith('core/checkpoint/') for f in files)} |\n"
    print(table)
    if args.files:
        for what, files in (("save", save), ("resume", loaded)):
            print(f"{what}:\n" + "".join(f"  {f}\n" for f in sorted(files)))
    if args.record:
        from bench.common import report

        report("checkpoint files traced", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
