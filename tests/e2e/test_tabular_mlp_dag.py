"""The tabular_mlp DAG run by Airflow (dag.test) against real torchrun ranks and a real MLflow store."""

import json

import numpy as np
import pytest

from pipeline.dev.demo import run_dag
from pipeline.stages.run import RunInfo
from tests.processes import parent
from tests.selfcontained import predict_in_fresh_interpreter

pytestmark = pytest.mark.e2e

TINY = {
    "epochs": 4,
    "batch_size": 64,
    "hidden_sizes": [32, 16],
    "learning_rate": 0.005,
    "overrides": {"data.shard_size_limit_bytes": 16384, "train.log_every_steps": 20},
}


def _state(dag_run) -> str:
    return str(getattr(dag_run.state, "value", dag_run.state))


def _extra_links(run_id: str, key: str) -> dict[str, str]:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        rows = session.scalars(XComModel.get_many(run_id=run_id, key=key, dag_ids="tabular_mlp")).all()
        return {row.task_id: XComModel.deserialize_value(row) for row in rows}


def _summary(dag_run) -> dict:
    return json.loads((RunInfo("tabular_mlp", dag_run.run_id).workdir / "summary.json").read_text())


def test_runs_register_promote_and_compare_with_the_champion(airflow_db, demo_parquet, tmp_path):
    from pipeline.registry import models
    from pipeline.registry.tracking import RUN_KEY_TAG, client

    # A model of its own (the model_name Param): other tests of the session register tabular_mlp versions.
    model = "tabular_mlp_two_runs"
    conf = {"input_path": str(demo_parquet), **TINY, "model_name": model,
            "overrides": {**TINY["overrides"], "registry.experiment": model}}
    first = run_dag("tabular_mlp", conf)
    assert _state(first) == "success"
    one = _summary(first)
    metrics = one["test_metrics"]
    assert metrics["accuracy"] >= metrics["majority_rate"] + 0.10, metrics
    assert one["promoted"] and one["champion_before"] is None
    assert str(models.version_by_alias(model, "champion").version) == one["model"]["version"]

    # The gate forced to pass: any challenger gains at least -1 accuracy.
    second = run_dag("tabular_mlp", {**conf, "seed": 1,
                                     "overrides": {**conf["overrides"], "evaluate.min_improvement": -1.0}})
    assert _state(second) == "success"
    two = _summary(second)
    assert two["gate"]["passed"] and two["promoted"]
    assert two["dataset"]["version"] == one["dataset"]["version"] and two["dataset"]["reused"]
    assert two["model"]["version"] != one["model"]["version"]
    assert two["champion_before"]["version"] == one["model"]["version"]
    assert two["champion_before"]["metrics"]["rows"] == metrics["rows"]  # the same test split

    # The gate forced to fail: no challenger gains a whole unit of accuracy. The champion stays.
    third = run_dag("tabular_mlp", {**conf, "seed": 2,
                                    "overrides": {**conf["overrides"], "evaluate.min_improvement": 1.0}})
    assert _state(third) == "success"
    three = _summary(third)
    assert not three["gate"]["passed"] and not three["promoted"]
    assert "< required +1.0000" in three["gate"]["reason"]
    assert client().get_model_version(model, three["model"]["version"]).tags["promotion.decision"] == "rejected"
    assert str(models.version_by_alias(model, "champion").version) == two["model"]["version"]

    versions = client().search_model_versions(f"name = '{model}'")
    assert sorted(v.tags[RUN_KEY_TAG] for v in versions) == sorted(
        f"tabular_mlp/{r.run_id}" for r in (first, second, third))
    second_version = client().get_model_version(model, two["model"]["version"])
    assert second_version.tags["promotion.decision"] == "promoted"
    assert second_version.tags["dataset.version"] == one["dataset"]["version"]
    assert str(models.version_by_alias(model, "champion").version) == two["model"]["version"]

    # Lineage: one MLflow run per DAG run, tagged, with the dataset as its input and the report as artifacts.
    mlflow_run = client().get_run(two["model"]["mlflow_run_id"])
    tags = mlflow_run.data.tags
    assert tags["airflow.dag_id"] == "tabular_mlp" and tags["airflow.run_id"] == second.run_id
    assert tags["airflow.try_number"] == "1" and tags["airflow.logical_date"]
    assert tags["airflow.url"].endswith("/dags/tabular_mlp/runs/" + second.run_id.replace(":", "%3A").replace("+", "%2B"))
    assert tags["dataset.version"] == one["dataset"]["version"] and tags["code.version"] and tags["config.digest"]
    inputs = mlflow_run.inputs.dataset_inputs
    assert [d.dataset.digest for d in inputs] == [one["dataset"]["version"]]
    artifacts = {a.path for a in client().list_artifacts(mlflow_run.info.run_id, "evaluation")}
    assert {"evaluation/report.html", "evaluation/confusion_matrix.png", "evaluation/training_curves.png"} <= artifacts
    for key in ("airflow.run_id", "airflow.url", "code.version", "config.digest"):
        assert second_version.tags[key] == tags[key]
    assert second_version.tags["validation_status"] == "passed"
    assert json.loads(second_version.tags["validation.guardrails"])[0]["metric"] == "macro_f1"
    assert two["gate"]["primary"]["champion"] == pytest.approx(metrics["accuracy"], abs=1e-6)
    train_loss = client().get_metric_history(mlflow_run.info.run_id, "train_loss")
    assert len(train_loss) == TINY["epochs"]
    # Every rank's own figures (pipeline.job.telemetry), relayed beside rank 0's metrics, and the stragglers tag.
    for rank in range(int(tags["launch.world_size"])):
        for figure in ("compute_s", "step_time_s", "samples_per_s", "data_wait_fraction", "straggler_score"):
            assert client().get_metric_history(mlflow_run.info.run_id, f"rank_{rank}/{figure}"), (rank, figure)
    assert "stragglers" in tags
    assert client().get_metric_history(mlflow_run.info.run_id, "node_0/cpu_percent")  # the node, once
    # What training cost (hours; no price set), on the run and the registered version.
    assert float(tags["cost.node_hours"]) > 0 and tags["cost.attempts"] == "1"
    assert second_version.tags["cost.node_hours"] == tags["cost.node_hours"]
    # The job view's figures (the UI's "Training job" tab) of the ended job: its MLflow run, its ranks, its cost.
    from pipeline.job.live import live
    from pipeline.job_files import JobFiles

    view = live(JobFiles(RunInfo("tabular_mlp", second.run_id).job_dir("train")))
    assert view["state"] == "finished" and view["world_size"] == int(tags["launch.world_size"])
    assert view["mlflow"]["run_id"] == mlflow_run.info.run_id and view["mlflow"]["url"].endswith(mlflow_run.info.run_id)
    assert view["cost"]["attempts"] == 1

    # Airflow -> MLflow: the "MLflow" extra link of train, register_model and evaluate.
    links = _extra_links(second.run_id, "_link_MlflowLink")
    assert set(links) == {"train", "register_model", "evaluate"}
    assert links["train"].endswith(f"/runs/{mlflow_run.info.run_id}")
    assert links["register_model"].endswith(f"/#/models/{model}/versions/{two['model']['version']}")
    assert links["evaluate"].endswith("/artifacts/evaluation/report.html")

    # The registered model scores raw rows straight from the input Parquet, in an interpreter where this
    # project cannot be imported.
    import mlflow.pyfunc
    import pyarrow.parquet as pq

    rows = pq.read_table(demo_parquet).slice(0, 8).to_pandas().drop(columns=["label"])
    scored = mlflow.pyfunc.load_model(f"models:/{model}@champion").predict(rows)
    assert len(scored) == 8 and set(scored["prediction"]) <= {0, 1, 2}
    assert predict_in_fresh_interpreter(f"models:/{model}@champion", rows, tmp_path) == [
        str(p) for p in scored["prediction"]]


def test_a_champion_trained_on_other_columns_is_not_comparable_and_is_kept(airflow_db, demo_parquet, tmp_path):
    """Triggering the DAG on another table under the same model name: the gate fails with the reason,
    evaluate is not retried, the run ends cleanly and the champion stays."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.registry import models

    model = "tabular_mlp_other_tables"
    conf = {**TINY, "model_name": model, "epochs": 1}
    first = run_dag("tabular_mlp", {**conf, "input_path": str(demo_parquet)})
    assert _state(first) == "success"
    champion = _summary(first)["model"]["version"]

    rng = np.random.default_rng(0)
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"height": rng.normal(size=600), "weight": rng.normal(size=600),
                             "label": rng.integers(0, 2, size=600)}), other)
    second = run_dag("tabular_mlp", {**conf, "input_path": str(other)})
    assert _state(second) == "success"
    tries = {ti.task_id: ti.try_number for ti in second.get_task_instances()}
    assert tries["evaluate"] == 1
    summary = _summary(second)
    assert not summary["gate"]["passed"] and not summary["promoted"]
    assert "champion not comparable" in summary["gate"]["reason"] and "height" in summary["gate"]["reason"]
    assert str(models.version_by_alias(model, "champion").version) == champion


def test_a_bad_param_is_refused_when_the_run_is_triggered(airflow_db, demo_parquet):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError) as err:
        run_dag("tabular_mlp", {"input_path": str(demo_parquet), "nproc_per_node": 0})
    assert "nproc_per_node" in str(err.value)


def test_bad_data_fails_the_run_at_once_without_retries(airflow_db, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1.0, 2.0], "y": [0, 1]}), tmp_path / "no_label.parquet")
    dag_run = run_dag("tabular_mlp", {"input_path": str(tmp_path / "no_label.parquet")})
    assert _state(dag_run) == "failed"
    states = {ti.task_id: (str(ti.state), ti.try_number) for ti in dag_run.get_task_instances()}
    assert states["prepare_data"] == ("failed", 1)
    assert states["train"][0] in ("upstream_failed", "None")


def test_remote_mlflow_credentials_come_from_a_connection_and_stay_out_of_logs(
    airflow_db, demo_parquet, tmp_path, monkeypatch, capfd
):
    from mlflow import MlflowClient

    from tests.services import MlflowServer

    server = MlflowServer(f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts")
    server.start()
    try:
        password = "pw-9f3b7c1e-not-for-logs"
        monkeypatch.setenv("AIRFLOW_CONN_MLFLOW_DEFAULT", json.dumps(
            {"conn_type": "http", "host": "127.0.0.1", "port": server.port, "login": "trainer", "password": password}))
        # Restored after the test: tasks run in this process under dag.test and export the connection.
        for key in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            monkeypatch.setenv(key, "unset")
        conf = {"input_path": str(demo_parquet), **TINY, "epochs": 1,
                "overrides": {**TINY["overrides"], "registry.model_name": "remote_check",
                              "registry.experiment": "remote_check"}}
        dag_run = run_dag("tabular_mlp", conf)
        assert _state(dag_run) == "success"
        versions = MlflowClient(server.url).search_model_versions("name = 'remote_check'")
        assert len(versions) == 1  # the run went to the server named by the connection
        captured = capfd.readouterr()
        assert password not in captured.out + captured.err
        logs = [p for p in (RunInfo("tabular_mlp", dag_run.run_id).workdir / "train").rglob("*") if p.is_file()]
        assert all(password not in p.read_text(errors="replace") for p in logs)
    finally:
        server.stop()



def test_require_approval_waits_for_a_person_through_the_api(airflow_db, demo_parquet, tmp_path):
    import threading
    import time
    import urllib.error
    from urllib.parse import quote

    from pipeline.registry import models
    from tests.services import AirflowApiServer

    api = AirflowApiServer(tmp_path)
    api.start()
    approver = {}
    assert models.version_by_alias("approval_check", "champion") is None  # also imports mlflow in this thread

    def approve_when_asked():
        # A person answering in the UI. HTTP only: importing Airflow's ORM models from a second
        # thread while dag.test runs deadlocks on the import lock.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                waiting = api.request("GET", "/api/v2/dags/tabular_mlp/dagRuns/~/taskInstances"
                                             "?task_id=approve&state=awaiting_input")["task_instances"]
            except urllib.error.HTTPError as exc:  # 404 until dag.test has serialized the DAG
                approver["last_error"] = repr(exc)
                waiting = []
            if waiting:
                run_id = waiting[0]["dag_run_id"]
                approver["champion_before_answer"] = models.version_by_alias("approval_check", "champion")
                approver["response"] = api.request(
                    "PATCH", f"/api/v2/dags/tabular_mlp/dagRuns/{quote(run_id, safe='')}/taskInstances/approve/-1/hitlDetails",
                    {"chosen_options": ["Approve"]})
                return
            time.sleep(1)

    thread = threading.Thread(target=approve_when_asked, daemon=True)
    thread.start()
    try:
        conf = {"input_path": str(demo_parquet), **TINY, "epochs": 1, "require_approval": True,
                "overrides": {**TINY["overrides"], "registry.model_name": "approval_check"}}
        dag_run = run_dag("tabular_mlp", conf)
        thread.join(timeout=10)
    finally:
        api.stop()
    assert approver.get("response", {}).get("chosen_options") == ["Approve"], approver
    assert approver["champion_before_answer"] is None  # nothing moved before the answer
    assert _state(dag_run) == "success"
    summary = _summary(dag_run)
    assert summary["promoted"] and "approved by" in summary["reason"], summary["reason"]
    assert str(models.version_by_alias("approval_check", "champion").version) == summary["model"]["version"]


def test_a_train_attempt_that_dies_mid_training_is_retried_from_its_checkpoint(airflow_db, demo_parquet, monkeypatch):
    """Every process of the first attempt's job is SIGKILLed (a lost node); Airflow's retry resumes."""
    import os
    import signal
    import threading
    import time

    from pipeline import deployment
    from pipeline.job_files import read_heartbeats

    monkeypatch.setenv("PIPELINE_RETRY_DELAY_S", "1")
    runs = deployment.runs_dir() / "tabular_mlp"
    before = set(runs.glob("*")) if runs.exists() else set()
    killed = {}

    def kill_first_attempt():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            for workdir in set(runs.glob("*")) - before:
                if list((workdir / "train" / "checkpoints").glob("step-*")):
                    beats = read_heartbeats(workdir / "train" / "progress")
                    if len(beats) == 2:
                        ranks = [beat["pid"] for beat in beats.values()]
                        agent = parent(ranks[0])
                        killed["pids"] = [parent(agent), agent, *ranks]  # guard, torchrun agent, ranks
                        for pid in killed["pids"]:
                            os.kill(pid, signal.SIGKILL)
                        return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_first_attempt, daemon=True)
    watcher.start()
    conf = {"input_path": str(demo_parquet), **TINY, "seed": 7, "checkpoint_every_steps": 10}
    dag_run = run_dag("tabular_mlp", conf)
    watcher.join(timeout=5)
    assert killed, "the first attempt was never killed"
    assert _state(dag_run) == "success"
    result = json.loads((RunInfo("tabular_mlp", dag_run.run_id).workdir / "train" / "result.json").read_text())
    print(f"retry resumed at step {result['start_step']} of {result['steps']} from {result['resumed_from']}")
    assert result["start_step"] > 0 and result["resumed_from"]
    assert result["steps"] > result["start_step"]
