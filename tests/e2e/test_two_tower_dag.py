"""The two_tower DAG run by Airflow: synthetic interactions with planted preferences -> MDS split by
time -> Lightning DDP on 2 torchrun ranks -> MLflow -> retrieval evaluation against the popularity
baseline -> the registered model answering in an interpreter without this project."""

import json

import pandas as pd
import pytest

from pipeline.dev.demo import run_dag
from pipeline.stages.run import RunInfo
from tests.selfcontained import predict_in_fresh_interpreter

pytestmark = pytest.mark.e2e


def test_the_recommender_beats_the_popularity_baseline_end_to_end(airflow_db, pipeline_home, tmp_path):
    from pipeline.recipes.two_tower.synthetic import write_interactions
    from pipeline.registry.tracking import client

    data = write_interactions(pipeline_home / "inputs" / "interactions" / "tiny.parquet", users=600, items=150,
                              clusters=8, per_user=15)
    model = "two_tower_e2e"
    dag_run = run_dag("two_tower", {"input_path": str(data), "variant": "tiny", "model_name": model})
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "success"
    summary = json.loads((RunInfo("two_tower", dag_run.run_id).workdir / "summary.json").read_text())
    rows = summary["dataset"]["rows"]
    assert rows["test"] == rows["val"] == 600  # each user's newest interaction, and the one before
    metrics = summary["test_metrics"]
    run_id = summary["model"]["mlflow_run_id"]
    # The popularity baseline's figures are the run's baseline_test_* metrics (and the report's baseline column).
    logged = client().get_run(run_id).data.metrics
    print(json.dumps(metrics), json.dumps(logged))
    assert metrics["recall_at_10"] > logged["baseline_test_recall_at_10"], logged
    assert metrics["recall_at_50"] >= metrics["recall_at_10"] and 0 < metrics["ndcg_at_10"] <= 1
    assert metrics["coverage_at_10"] > logged["baseline_test_coverage_at_10"]
    assert summary["train"]["world_size"] == 2 and summary["promoted"]

    artifacts = {a.path for a in client().list_artifacts(run_id, "evaluation")}
    assert {"evaluation/report.html", "evaluation/metrics.json"} <= artifacts
    history = client().get_metric_history(run_id, "val_loss")
    assert len(history) == 3  # one per epoch, through the run context's metrics sink

    users = pd.DataFrame({"user_id": ["u00001", "u00002", "someone-new"], "user_segment": ["s1", "s2", "s9"],
                          "user_age": [30.0, 41.0, 25.0]})
    answer = predict_in_fresh_interpreter(f"models:/{model}@champion", users, tmp_path, column="item_ids")
    assert len(answer) == 3 and all(len(items) == 100 for items in answer)
    assert all(item.startswith("i") for items in answer for item in items)
    # A request's k parameter (declared in the signature, model.top_k by default) sets how many come back.
    import mlflow.pyfunc

    assert [len(items) for items in mlflow.pyfunc.load_model(f"models:/{model}@champion").predict(
        users, params={"k": 60})["item_ids"]] == [60, 60, 60]
