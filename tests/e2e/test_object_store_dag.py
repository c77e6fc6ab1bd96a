"""The tabular_mlp DAG run by Airflow (dag.test) with its dataset versions on an S3 API server (moto's, on
127.0.0.1; ``PIPELINE_DATA_DIR=s3://...``): prepare_data publishes there, the real torchrun ranks, the evaluation
and the registration read it through their node-local caches, and no version is written under the local data
folder; its checkpoints go to the bucket too (``train.checkpoint_uri``), none to the job folder."""

import json
from pathlib import Path

import pytest

from pipeline import deployment, storage
from pipeline.dev.demo import run_dag
from pipeline.stages.run import RunInfo

pytestmark = pytest.mark.e2e


@pytest.fixture
def asset_name_free(airflow_db):
    """The session's metadata DB has the ``tabular_mlp`` asset active at its folder URI (other tests' runs); active
    assets have unique names, so the bucket's asset would stay inactive and its task refused. Its active entry is
    set aside for this test and put back after, what the scheduler's orphanage pass does when a deployment moves
    its data (the old URI no longer declared by any DAG file); and the DAG files are parsed and stored again with
    the folder's URIs, so that the next runs' DAG versions declare them."""
    from airflow.models.asset import AssetActive
    from airflow.utils.session import create_session
    from sqlalchemy import delete, select

    with create_session() as session:
        kept = [(row.name, row.uri) for row in session.scalars(select(AssetActive).where(AssetActive.name == "tabular_mlp"))]
        session.execute(delete(AssetActive).where(AssetActive.name == "tabular_mlp"))
    yield
    with create_session() as session:
        session.execute(delete(AssetActive).where(AssetActive.name == "tabular_mlp"))
        session.add_all([AssetActive(name=name, uri=uri) for name, uri in kept])
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    sync_bag_to_db(DagBag(dag_folder=str(deployment.PROJECT_ROOT / "dags")), "dags-folder", None)


def test_the_dag_trains_on_a_version_published_to_and_read_from_the_bucket(asset_name_free, demo_parquet, s3, tmp_path,
                                                                           monkeypatch):
    from pipeline.registry.tracking import client

    monkeypatch.setenv("PIPELINE_DATA_DIR", f"{s3}/datasets")
    monkeypatch.setenv("PIPELINE_STAGING_DIR", str(tmp_path / "staging"))
    local_before = set(Path(deployment.home(), "data").rglob("manifest.json"))
    model = "tabular_mlp_on_s3"
    conf = {"input_path": str(demo_parquet), "epochs": 2, "batch_size": 64, "hidden_sizes": [32, 16],
            "model_name": model, "overrides": {"data.shard_size_limit_bytes": 16384, "registry.experiment": model,
                          "train.checkpoint_uri": f"{s3}/checkpoints"}}
    dag_run = run_dag("tabular_mlp", conf)
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "success"

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
