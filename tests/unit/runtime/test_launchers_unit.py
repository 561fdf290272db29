"""launchers/remote.sh end to end on CPU: runs, and after a SIGKILL restarts and resumes."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow


# A stand-in trainer (torchrun) for the launchers' restart logic: each attempt does what FAKE_ATTEMPTS says, in turn,
# and dies (exit 1): "progress" commits a newer checkpoint (a step_ folder with COMMITTED, as core/checkpoint/folders.py
# commits them), "uncommitted" leaves one without COMMITTED (a save killed before its commit), "stalled" writes
# the watchdog's exit_status.json, "diverged" the one of a run stopped as diverged (exit code 3), "disk_full" only
# prints rank 0's line of a save that failed (exit_status.json did not fit either), "outlived" has a rank that ends
# at once and then never ends itself (torchrun waiting on a lost node's store), "ended_in_barrier" too, once rank 0 has
# recorded a stop by a signal (torchrun in its exit barrier, waiting for a pre-empted node's agent), "stuck" does nothing. Each writes
# run_info.json as rank 0 does.
FAKE_TRAINER = """
import json, os, subprocess, sys, time
from pathlib import Path
out = Path(os.environ["OUTPUT_DIR"])
ckpts = out / "checkpoints"
count = out / "attempts"
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
what = os.environ["FAKE_ATTEMPTS"].split(",")[n]
(out / "run_info.json").write_text(json.dumps({"checkpoint_dir": str(ckpts)}))
newest = max([int(p.name[5:]) for p in ckpts.glob("step_*") if (p / "COMMITTED").exists()], default=0)
if what in ("progress", "uncommitted"):
    (ckpts / f"step_{newest + 5:09d}").mkdir(parents=True)
if what == "progress":
    (ckpts / f"step_{newest + 5:09d}" / "COMMITTED").write_text("{}")
if what == "stalled":
    (out / "exit_status.json").write_text(json.dumps({"exit_code": 1, "reason": "stalled", "step": newest, "detail": "no progress"}))
if what == "diverged":
    (out / "exit_status.json").write_text(json.dumps({"exit_code": 3, "reason": "diverged", "step": newest, "detail": "nan"}))
if what == "disk_full":
    print(f"plait: error: checkpoint save at step {newest + 5} failed on rank 0: OSError: [Errno 28] No space left on device", flush=True)
if what == "outlived":
    subprocess.run([sys.executable, "-c", "import time; time.sleep(2)"])
    time.sleep(600)
if what == "ended_in_barrier":
    subprocess.run([sys.executable, "-c", "import time; time.sleep(2)"])
    (out / "exit_status.json").write_text(json.dumps({"exit_code": 0, "reason": "signal", "step": newest, "detail": "SIGTERM"}))
    time.sleep(600)
sys.exit(1)
"""

# The launchers' python: the stand-in trainer for torchrun, nothing for the installation check, the output folder for
# core.plan (--json).
FAKE_PYTHON = """#!/bin/bash
case " $* " in
    *" torch.distributed.run "*) exec "$REAL_PY" "$FAKE_TRAINER" ;;
    *" core.plan "*) printf '{"output_dir": "%s"}\\n' "$OUTPUT_DIR"; exit 0 ;;
esac
if [ "$1" = - ]; then cat > /dev/null; echo "gpus 0"; exit 0; fi
exec "$REAL_PY" "$@"
"""


def test_the_k8s_job_fails_at_once_on_every_end_that_remote_sh_does_not_restart():
    """The Job retried a pod that exited 3 (diverged) or 4 (a monitor failed), so a diverged run was started again up
    to backoffLimit times, where remote.sh stops; now its podFailurePolicy fails the Job on every exit code of the
    trainer that no launcher restarts (core.contract.errors, core.checkpoint.folders, the budget guard)."""
    from core.checkpoint.folders import EXIT_SAVE_FAILED
    from core.contract.errors import EXIT_BAD_INPUT
    from plugins.monitors.budget_guard import EXIT_PROJECTED_OVER_CAP, EXIT_SPENT_OVER_CAP

    job = (REPO / "launchers" / "k8s" / "job.yaml").read_text()
    values = re.search(r"action: FailJob.*\n\s*onExitCodes: \{containerName: trainer, operator: In, values: \[([0-9, ]+)\]\}", job)
    assert values is not None, job
    assert {int(v) for v in values.group(1).split(",")} == {
        EXIT_BAD_INPUT,
        3,
        4,
        EXIT_SAVE_FAILED,
        EXIT_PROJECTED_OVER_CAP,
        EXIT_SPENT_OVER_CAP,
    }  # 3 diverged, 4 a monitor failed
