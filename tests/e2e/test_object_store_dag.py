"""The tabular_mlp DAG run by Airflow (dag.test) with its dataset versions on an S3 API server (moto's, on
127.0.0.1; ``PIPELINE_DATA_DIR=s3://...``): prepare_data publishes there, the real torchrun ranks, the evaluation
and the registration read it through their node-local caches, and no version is written under the local data
folder; its checkpoints go to the bucket too (``train.checkpoint_uri``), none to the job folder, and so do MLflow's
artifacts (``PIPELINE_MLFLOW_ARTIFACTS``): the registered model loads from there.

The store's endpoint and key pair come only from an Airflow connection (``aws_default``, here from its
``AIRFLOW_CONN_`` variable; the test's own environment has none): the run succeeding means every task and rank got
them, and the secret key appears in none of the task logs, XComs, the job folder's files, the MLflow run's params
and tags, the registered version's tags, nor the Kubernetes manifests and the Ray job request the same train job
would be sent as."""

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline import deployment, storage
from pipeline.dev.demo import run_dag
from pipeline.stages.run import RunInfo
from tests.selfcontained import digit_images, predict_in_fresh_interpreter

pytestmark = pytest.mark.e2e


NAMES = ("tabular_mlp", "image_classifier")  # the DAGs run here, whose datasets' assets move to the bucket


@pytest.fixture
def asset_name_free(airflow_db):
    """The session's metadata DB has the ``tabular_mlp`` and ``image_classifier`` assets active at their folder URIs
    (other tests' runs); active assets have unique names, so the bucket's assets would stay inactive and their tasks
    refused. Their active entries are set aside for this test and put back after, what the scheduler's orphanage pass
    does when a deployment moves its data (the old URI no longer declared by any DAG file); and the DAG files are
    parsed and stored again with the folder's URIs, so that the next runs' DAG versions declare them.

    Airflow skips storing a DAG parsed within ``[core] min_serialized_dag_update_interval`` (30 s) of its last
    write: the run would get the version an earlier test stored moments before, with the folder's URI. Here every
    parse is stored."""
    from airflow.models.asset import AssetActive
    from airflow.utils.session import create_session
    from sqlalchemy import delete, select

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL", "0")
        with create_session() as session:
            kept = [(row.name, row.uri)
                    for row in session.scalars(select(AssetActive).where(AssetActive.name.in_(NAMES)))]
            session.execute(delete(AssetActive).where(AssetActive.name.in_(NAMES)))
        yield
        with create_session() as session:
            session.execute(delete(AssetActive).where(AssetActive.name.in_(NAMES)))
            session.add_all([AssetActive(name=name, uri=uri) for name, uri in kept])
        from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

        sync_bag_to_db(DagBag(dag_folder=str(deployment.PROJECT_ROOT / "dags")), "dags-folder", None)


@pytest.fixture
def s3_by_connection(s3_server, monkeypatch):
    """A bucket, and the store's settings only in the ``aws_default`` connection; the environment as it was after
    (the tasks run in this process, and put the connection's settings in its environment)."""
    import uuid

    bucket = s3_server.bucket(f"test-{uuid.uuid4().hex[:12]}")
    before = dict(os.environ)
    for key in s3_server.env():
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps({
        "conn_type": "aws", "login": s3_server.access_key, "password": s3_server.secret_key,
        "extra": {"endpoint_url": s3_server.endpoint, "region_name": s3_server.REGION}}))
    yield bucket
    os.environ.clear()
    os.environ.update(before)


def _containing(secret: str, texts: dict[str, str]) -> list[str]:
    return [where for where, text in texts.items() if secret in text]


def test_the_dag_trains_on_a_version_published_to_and_read_from_the_bucket(asset_name_free, demo_parquet, s3_server,
                                                                           s3_by_connection, tmp_path, monkeypatch,
                                                                           capfd):
    from pipeline.registry.tracking import client

    s3 = s3_by_connection
    monkeypatch.setenv("PIPELINE_DATA_DIR", f"{s3}/datasets")
    monkeypatch.setenv("PIPELINE_STAGING_DIR", str(tmp_path / "staging"))
    monkeypatch.setenv("PIPELINE_MLFLOW_ARTIFACTS", f"{s3}/mlflow")
    local_before = set(Path(deployment.home(), "data").rglob("manifest.json"))
    model = "tabular_mlp_on_s3"
    conf = {"input_path": str(demo_parquet), "epochs": 2, "batch_size": 64, "hidden_sizes": [32, 16],
            "model_name": model, "overrides": {"data.shard_size_limit_bytes": 16384, "registry.experiment": model,
                          "train.checkpoint_uri": f"{s3}/checkpoints"}}
    dag_run = run_dag("tabular_mlp", conf)
    logs = capfd.readouterr()
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "success"
    for key, value in s3_server.env().items():  # what the tasks were given, to read the bucket as the test does
        os.environ[key] = value

    workdir = RunInfo("tabular_mlp", dag_run.run_id).workdir
    summary = json.loads((workdir / "summary.json").read_text())
    uri = summary["dataset"]["uri"]
    assert uri.startswith(f"{s3}/datasets/tabular_mlp/"), uri
    manifest = storage.read_json(storage.join(uri, "manifest.json"))
    assert summary["dataset"]["version"] == manifest["version"]
    assert set(Path(deployment.home(), "data").rglob("manifest.json")) == local_before  # nothing published locally
    assert [p for p in (tmp_path / "staging").rglob("*") if p.is_file()] == []  # versions, checkpoints: all uploaded

    # The checkpoints are on the bucket, under the job's own prefix, each with its marker; none in the job folder.
    checkpoints = storage.join(f"{s3}/checkpoints", workdir.relative_to(deployment.runs_dir()).as_posix(), "train")
    saved = storage.sizes(checkpoints)
    folders = {key.split("/")[0] for key in saved}
    assert folders and all(name.startswith("step-") and f"{name}/COMPLETE" in saved for name in folders), saved
    assert not (workdir / "train" / "checkpoints").exists()

    # The ranks' node-local cache holds the train split's shards, downloaded and checked.
    cache = workdir / "train" / "cache" / "node-0" / manifest["version"] / "train"
    downloaded = sorted(p.relative_to(cache).as_posix() for p in cache.rglob("shard.*.mds"))
    assert len(downloaded) == len(manifest["shards"]["train"]) > 1
    metrics = summary["test_metrics"]
    assert metrics["accuracy"] >= metrics["majority_rate"] + 0.05, metrics

    # MLflow records the version where it lies: on the bucket.
    run = client().get_run(summary["model"]["mlflow_run_id"])
    sources = [json.loads(d.dataset.source) for d in run.inputs.dataset_inputs]
    assert any(uri in json.dumps(s) for s in sources), sources

    # MLflow's artifacts are on the bucket, none in the local artifact folder; the registered model loads from the
    # bucket in an interpreter that cannot import the project.
    experiment = client().get_experiment(run.info.experiment_id)
    assert experiment.artifact_location == f"{s3}/mlflow"
    artifacts = storage.sizes(f"{s3}/mlflow")
    assert f"{run.info.run_id}/artifacts/evaluation/report.html" in artifacts, sorted(artifacts)
    assert any(key.endswith("/MLmodel") for key in artifacts), sorted(artifacts)
    assert not any(run.info.run_id in str(p) for p in Path(deployment.home(), "mlflow").rglob("*"))
    rows = pq.read_table(demo_parquet).slice(0, 8).to_pandas().drop(columns=["label"])
    predictions = predict_in_fresh_interpreter(f"models:/{model}@champion", rows, tmp_path,
                                               env={"MLFLOW_TRACKING_URI": deployment.mlflow_tracking_uri()})
    assert len(predictions) == 8 and set(predictions) <= {"0", "1", "2"}, predictions

    # The secret is nowhere it could be read back.
    secret = s3_server.secret_key
    texts = {"task logs": logs.out + logs.err}
    assert "checkpoint step" in texts["task logs"]  # the ranks' lines are in what was captured
    airflow_logs = Path(os.environ.get("AIRFLOW_HOME", deployment.home() / "airflow"), "logs")
    texts |= {str(p): p.read_text(errors="replace") for p in airflow_logs.rglob("*") if p.is_file()}
    texts |= {str(p): p.read_bytes().decode(errors="replace") for p in workdir.rglob("*") if p.is_file()}
    texts |= {f"xcom {task}": json.dumps(value, default=str) for task, value in _xcoms(dag_run.run_id).items()}
    texts["mlflow params and tags"] = json.dumps([run.data.params, run.data.tags])
    version = client().get_model_version(model, summary["model"]["version"])
    texts["model version tags"] = json.dumps(version.tags)
    texts |= _rendered_elsewhere(_xcoms(dag_run.run_id)["prepare_data/return_value"], dag_run.run_id, conf)
    assert _containing(secret, texts) == []


def _xcoms(run_id: str) -> dict:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.scalars(select(XComModel).where(XComModel.run_id == run_id)).all()
        return {f"{row.task_id}/{row.key}": XComModel.deserialize_value(row) for row in rows}


def _rendered_elsewhere(prepared: dict, run_id: str, conf: dict) -> dict[str, str]:
    """The Kubernetes manifests and the Ray job request of the same train job, rendered while this process's
    environment holds the connection's settings (as the train task's does)."""
    from kubernetes.client import ApiClient

    from pipeline.airflow.connections import storage_connection, storage_env_from_connection
    from pipeline.results import PreparedData
    from pipeline.job.kubernetes.place import manifests_for
    from pipeline.job.ray.place import job_request
    from pipeline.job.spec import Attempt
    from pipeline.recipes import tabular_mlp
    from pipeline.stages.training import train_job

    os.environ.update(storage_env_from_connection(storage_connection()))
    cfg = tabular_mlp.config("tiny").with_overrides({"train.checkpoint_uri": conf["overrides"]["train.checkpoint_uri"]})
    dataset = PreparedData.from_xcom(prepared)
    run = RunInfo("tabular_mlp", run_id)
    rendered = {}
    for kind in ("kubernetes", "ray"):
        place = {"launch.kind": kind} | ({"launch.kubernetes.volumes": [f"pipeline-runs:{deployment.runs_dir()}"]}
                                         if kind == "kubernetes" else {})
        spec = train_job(cfg.with_overrides(place | {"registry.experiment": "tabular_mlp_rendered"}), run, dataset)
        attempt = Attempt(spec, 0)
        if kind == "kubernetes":
            manifests = manifests_for(attempt)
            rendered[kind] = json.dumps(ApiClient().sanitize_for_serialization([manifests.job, manifests.service]))
        else:
            rendered[kind] = json.dumps(job_request(attempt, local=False))
    return rendered


def test_the_image_dag_keeps_its_data_checkpoints_and_mlflow_artifacts_on_the_bucket(asset_name_free, s3_server,
                                                                                       s3_by_connection, tmp_path,
                                                                                       monkeypatch):
    """The image_classifier DAG (scikit-learn's digits as IDX files) with every place it writes on the bucket: its
    versions, its checkpoints and MLflow's artifacts; none of them under the pipeline's home."""
    import pandas as pd

    from pipeline.data.demo import write_digits_idx
    from pipeline.registry.tracking import client

    s3 = s3_by_connection
    for key, value in {"PIPELINE_DATA_DIR": f"{s3}/datasets", "PIPELINE_MLFLOW_ARTIFACTS": f"{s3}/mlflow",
                       "PIPELINE_STAGING_DIR": str(tmp_path / "staging")}.items():
        monkeypatch.setenv(key, value)
    home_before = {p for p in Path(deployment.home()).rglob("*") if p.is_file()}
    model = "digits_on_s3"
    conf = {"input_path": str(write_digits_idx(tmp_path / "digits")), "variant": "tiny", "model_name": model,
            "overrides": {"model.class_names": [f"digit-{d}" for d in range(10)], "registry.experiment": model,
                          "train.checkpoint_uri": f"{s3}/checkpoints"}}
    dag_run = run_dag("image_classifier", conf)
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "success"
    for key, value in s3_server.env().items():
        os.environ[key] = value

    workdir = RunInfo("image_classifier", dag_run.run_id).workdir
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["dataset"]["uri"].startswith(f"{s3}/datasets/image_classifier/") and summary["promoted"]
    assert summary["test_metrics"]["accuracy"] >= 0.3, summary["test_metrics"]
    on_bucket = storage.sizes(s3)
    job = workdir.relative_to(deployment.runs_dir()).as_posix()
    assert any(k.startswith(f"checkpoints/{job}/train/step-") and k.endswith("/COMPLETE") for k in on_bucket)
    run_id = summary["model"]["mlflow_run_id"]
    assert f"mlflow/{run_id}/artifacts/evaluation/confusion_matrix.png" in on_bucket, sorted(on_bucket)
    assert any(k.startswith("mlflow/") and k.endswith("/MLmodel") for k in on_bucket)
    # Under the home: the run's folder (its local ranks' job folder, the shards in the readers' node-local caches,
    # the evaluation report's working copy) and MLflow's database; no version, checkpoint or MLflow artifact.
    home = Path(deployment.home())
    written = {p.relative_to(home) for p in home.rglob("*") if p.is_file()} - {p.relative_to(home) for p in home_before}
    elsewhere = [p for p in written if p.parts[0] != "runs" and p.parts[:2] != ("mlflow", "mlflow.db")]
    assert elsewhere == [], elsewhere
    stored = [p for p in written if (p.suffix == ".mds" and "cache" not in p.parts) or "step-" in str(p)
              or p.name in ("MLmodel", "manifest.json", "COMPLETE")]
    assert stored == [], stored
    assert [p for p in (tmp_path / "staging").rglob("*") if p.is_file()] == []

    _, encoded = digit_images(10)
    predictions = predict_in_fresh_interpreter(f"models:/{model}@champion", pd.DataFrame({"image": encoded}), tmp_path,
                                               env={"MLFLOW_TRACKING_URI": deployment.mlflow_tracking_uri()})
    assert len(predictions) == 10 and set(predictions) <= {f"digit-{d}" for d in range(10)}
    assert client().get_experiment_by_name(model).artifact_location == f"{s3}/mlflow"
