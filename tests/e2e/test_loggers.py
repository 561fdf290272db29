"""The optional mlflow and wandb loggers, both local/offline, through a real run."""

from __future__ import annotations

import pytest
from conftest import run_module


def test_mlflow_local_file_store(tiny_config, tmp_path):
    mlflow = pytest.importorskip("mlflow", reason="mlflow-skinny is the optional extra 'mlflow' (in 'dev')")
    cfg = tiny_config(steps=3)
    proc = run_module("core.train", "--config", str(cfg), '--monitors.enabled=["jsonl", "mlflow"]')
    assert proc.returncode == 0, proc.stderr[-3000:]
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "out" / "mlruns"
    client = mlflow.tracking.MlflowClient(tracking_uri=store.resolve().as_uri())
    exp = client.get_experiment_by_name("plait")
    (run,) = client.search_runs([exp.experiment_id])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3]
    assert run.data.params["model.name"] == "llama3" and run.data.tags["end_reason"] == "completed"


def test_wandb_offline(tiny_config, tmp_path):
    pytest.importorskip("wandb", reason="wandb is the optional extra 'wandb' (in 'dev')")
    cfg = tiny_config(steps=3)
    proc = run_module(
        "core.train", "--config", str(cfg), '--monitors.enabled=["jsonl", "wandb"]', extra_env={"WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
