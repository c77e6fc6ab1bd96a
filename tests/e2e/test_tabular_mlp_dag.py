"""The tabular_mlp DAG run by Airflow (dag.test) against real torchrun ranks and a real MLflow store."""

import json

import pytest

from pipeline.demo import run_dag
from pipeline.stages import RunInfo

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


def _summary(dag_run) -> dict:
    return json.loads((RunInfo("tabular_mlp", dag_run.run_id).workdir / "summary.json").read_text())


def test_two_runs_register_promote_and_compare_with_the_champion(airflow_db, demo_parquet):
    from pipeline.registry import models
    from pipeline.registry.tracking import RUN_KEY_TAG, client

    first = run_dag("tabular_mlp", {"input_path": str(demo_parquet), **TINY})
    assert _state(first) == "success"
    one = _summary(first)
    metrics = one["test_metrics"]
    assert metrics["accuracy"] >= metrics["majority_rate"] + 0.10, metrics
    assert one["promoted"] and one["champion_before"] is None
    assert str(models.version_by_alias("tabular_mlp", "champion").version) == one["model"]["version"]

    second = run_dag("tabular_mlp", {"input_path": str(demo_parquet), **TINY, "seed": 1})
    assert _state(second) == "success"
    two = _summary(second)
    assert two["dataset"]["version"] == one["dataset"]["version"] and two["dataset"]["reused"]
    assert two["model"]["version"] != one["model"]["version"]
    assert two["champion_before"]["version"] == one["model"]["version"]
    assert two["champion_before"]["metrics"]["rows"] == metrics["rows"]  # the same test split

    versions = client().search_model_versions("name = 'tabular_mlp'")
    assert sorted(v.tags[RUN_KEY_TAG] for v in versions) == sorted(f"tabular_mlp/{r.run_id}" for r in (first, second))
    second_version = client().get_model_version("tabular_mlp", two["model"]["version"])
    assert second_version.tags["promotion.decision"] == ("promoted" if two["promoted"] else "rejected")
    assert second_version.tags["dataset.version"] == one["dataset"]["version"]
    champion = str(models.version_by_alias("tabular_mlp", "champion").version)
    assert champion == (two if two["promoted"] else one)["model"]["version"]

    # The registered model scores raw rows straight from the input Parquet.
    import mlflow.pyfunc
    import pyarrow.parquet as pq

    rows = pq.read_table(demo_parquet).slice(0, 8).to_pandas().drop(columns=["label"])
    scored = mlflow.pyfunc.load_model("models:/tabular_mlp@champion").predict(rows)
    assert len(scored) == 8 and set(scored["prediction"]) <= {0, 1, 2}


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
