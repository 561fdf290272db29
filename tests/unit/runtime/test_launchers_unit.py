"""The Kubernetes Job (launchers/k8s/job.yaml) fails at once on every exit code of the trainer that no
launcher restarts."""

from __future__ import annotations

import re

from conftest import REPO


def test_the_k8s_job_fails_at_once_on_every_end_that_remote_sh_does_not_restart():
    """The Job's podFailurePolicy fails the Job, as remote.sh stops, on every exit code of the trainer that no
    launcher restarts: bad input, diverged (3), a monitor failed (4), a failed save and the budget guard's two."""
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
