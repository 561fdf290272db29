"""``mlflow``: metrics to MLflow, a local file store by default (extra ``mlflow``)."""

from __future__ import annotations

from dataclasses import dataclass

from core.api import PluginError, hookimpl, option


@dataclass
class MLflowOptions:
    tracking_uri: str = option("", "MLflow tracking URI; empty: a file store in <output_dir>/mlruns")
    experiment: str = option("plait", "experiment name")
    run_name: str = option("", "run name; empty: the output folder's name")


def numeric(metrics) -> dict[str, float]:
    return {k.replace("/", "_"): float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


class MLflowLogger:
    def __init__(self, options: MLflowOptions) -> None:
        self.options = options
        self.mlflow = None

    @hookimpl
    def plait_train_start(self, run):
        if not run.dist.is_main:
            return
        try:
            import mlflow
        except ImportError as e:
            raise PluginError(f"monitor 'mlflow' needs mlflow (pip install 'plait[mlflow]'): {e}") from None
        o = self.options
        if not o.tracking_uri:  # the local file store (MLflow 3 asks for an explicit opt-in to it)
            import os

            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(o.tracking_uri or (run.output_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(o.experiment)
        mlflow.start_run(run_name=o.run_name or run.output_dir.name)
        flat = {}
        for section, table in run.config.items():
            if isinstance(table, dict):
                flat.update({f"{section}.{k}": str(v)[:500] for k, v in table.items() if not isinstance(v, dict)})
        mlflow.log_params(flat)
        self.mlflow = mlflow

    @hookimpl
    def plait_step_end(self, run, step, metrics):
        if metrics and self.mlflow is not None:
            self.mlflow.log_metrics(numeric(metrics), step=step)

    @hookimpl
    def plait_validation_end(self, run, step, metrics):
        if self.mlflow is not None:
            self.mlflow.log_metrics(numeric(metrics), step=step)

    @hookimpl
    def plait_train_end(self, run, reason):
        if self.mlflow is not None:
            self.mlflow.set_tag("end_reason", reason)
            self.mlflow.end_run(status="FINISHED" if reason in ("completed", "signal", "requested") else "FAILED")
            self.mlflow = None
