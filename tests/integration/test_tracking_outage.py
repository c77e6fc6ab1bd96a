"""A real `mlflow server` stopped mid-training and started again: training goes on, no metric is
lost; register_model fails as retryable while the server is down and succeeds after. The ranks never
import MLflow (the task relays rank 0's metrics file): a shadow ``mlflow`` package on their path fails
any import of it."""

import os
import threading
import time

import pytest

from pipeline import stages
from pipeline.errors import InfraError
from pipeline.recipes import tabular_mlp
from tests import jobs
from tests.services import MlflowServer

pytestmark = pytest.mark.distributed

OUTAGE_S = 20


def test_training_rides_out_a_tracking_outage_and_register_retries(demo_parquet, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    server = MlflowServer(f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts")
    server.start()
    shadow = tmp_path / "shadow" / "mlflow"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("a rank imported mlflow: ranks send no metrics")\n')
    try:
        path = [str(shadow.parent), os.environ.get("PYTHONPATH")]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, path)))
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
        monkeypatch.delenv("PIPELINE_MLFLOW_ARTIFACTS", raising=False)
        cfg = tabular_mlp.config("tiny").with_overrides({
            "data.input_path": str(demo_parquet), "train.epochs": 14, "train.log_every_steps": 5,
            "registry.experiment": "outage", "registry.model_name": "outage",
            "train.metrics_flush_timeout_s": 90.0,
        })
        run = stages.RunInfo("outage", "run-1")
        dataset = stages.prepare_data(cfg, run)
        watcher_client = MlflowClient(server.url)
        outage = {}

        def interrupt():
            # Wait until rank 0 is logging step metrics, then take the server away for OUTAGE_S.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    runs = watcher_client.search_runs(
                        [watcher_client.get_experiment_by_name("outage").experiment_id])
                    if runs and "step_loss" in runs[0].data.metrics:
                        break
                except Exception:
                    pass
                time.sleep(0.5)
            outage["stopped"] = time.monotonic()
            server.stop()
            time.sleep(OUTAGE_S)
            server.start()
            outage["back"] = time.monotonic()

        watcher = threading.Thread(target=interrupt)
        watcher.start()
        trained = jobs.train(cfg, run, dataset)
        training_done = time.monotonic()
        watcher.join(timeout=180)

        assert "stopped" in outage and outage["stopped"] < training_done, "the outage did not overlap training"
        assert trained.details["unsent_metrics"] == 0
        client = MlflowClient(server.url)
        steps = trained.details["steps"]
        step_losses = client.get_metric_history(trained.mlflow_run_id, "step_loss")
        expected = len([s for s in range(1, steps + 1) if s % cfg.train.log_every_steps == 0 or s == steps])
        assert len(step_losses) == expected
        assert len(client.get_metric_history(trained.mlflow_run_id, "val_loss")) == cfg.train.epochs
        print(f"outage {outage['back'] - outage['stopped']:.1f}s during training; {len(step_losses)}/{expected} "
              f"step metrics and {cfg.train.epochs}/{cfg.train.epochs} epoch metrics arrived")

        server.stop()
        started = time.monotonic()
        with pytest.raises(InfraError, match="unreachable while trying to register the model"):
            stages.register_model(cfg, run, dataset, trained)
        print(f"register_model with the server down failed as retryable after {time.monotonic() - started:.1f}s")
        server.start()
        registered = stages.register_model(cfg, run, dataset, trained)
        assert registered.version == "1" and registered.created
    finally:
        server.stop()
