"""``mlflow``: metrics to MLflow, a local file store by default (extra ``mlflow``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from core.api import option
from plugins.monitors.tracker import TrackerLogger


@dataclass
class MLflowOptions:
    tracking_uri: str = option("", "MLflow tracking URI; empty: a file store in <output_dir>/mlruns")
    experiment: str = option("plait", "experiment name")
    run_name: str = option("", "run name; empty: the output folder's name")


class MLflowLogger(TrackerLogger):
    package = "mlflow"

    def open(self, package, run):
        o = self.options
        if not o.tracking_uri:  # the local file store (MLflow 3 asks for an explicit opt-in to it)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        package.set_tracking_uri(o.tracking_uri or (run.output_dir / "mlruns").resolve().as_uri())
        package.set_experiment(o.experiment)
        package.start_run(run_name=o.run_name or run.output_dir.name)
        flat = {}
        for section, table in run.config.items():
            if isinstance(table, dict):
                flat.update({f"{section}.{k}": str(v)[:500] for k, v in table.items() if not isinstance(v, dict)})
        package.log_params(flat)
        return package

    def log(self, metrics, step):
        self.tracker.log_metrics(metrics, step=step)

    def close(self, reason):
        self.tracker.set_tag("end_reason", reason)
        self.tracker.end_run(status="FINISHED" if reason in ("completed", "signal", "requested") else "FAILED")
