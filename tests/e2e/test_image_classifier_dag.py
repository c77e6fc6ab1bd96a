"""The image_classifier DAG (the recipe seam's second workload) run by Airflow against real torchrun ranks
and a real MLflow store, on real data: scikit-learn's bundled digits written as IDX files."""

import json

import pytest

from pipeline.dev.demo import run_dag
from pipeline.stages.run import RunInfo
from tests.selfcontained import digit_images, predict_in_fresh_interpreter

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def digits_idx(pipeline_home):
    from pipeline.data.demo import write_digits_idx

    return write_digits_idx(pipeline_home / "inputs" / "digits")


def test_the_recipe_trains_registers_and_reports_through_the_shared_dag(airflow_db, digits_idx, tmp_path):
    from pipeline.registry.tracking import client

    model = "digits_e2e"
    dag_run = run_dag("image_classifier", {"input_path": str(digits_idx), "variant": "tiny", "model_name": model,
                                           "overrides": {"model.class_names": [f"digit-{d}" for d in range(10)]}})
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "success"
    summary = json.loads((RunInfo("image_classifier", dag_run.run_id).workdir / "summary.json").read_text())
    assert summary["dataset"]["rows"]["train"] > 1000 and summary["promoted"]
    metrics = summary["test_metrics"]
    assert metrics["accuracy"] >= 0.3, metrics  # ten classes: chance is 0.1; two tiny epochs learn far more
    assert summary["train"]["world_size"] == 2

    run_id = summary["model"]["mlflow_run_id"]
    artifacts = {a.path for a in client().list_artifacts(run_id, "evaluation")}
    assert {"evaluation/report.html", "evaluation/confusion_matrix.png", "evaluation/per_class_f1.png"} <= artifacts
    params = client().get_run(run_id).data.params
    assert params["recipe"] == "image_classifier" and json.loads(params["model.widths"]) == [8, 16]

    # The registered model, in an interpreter without this project, takes encoded images or pixel arrays
    # and answers with class names.
    import pandas as pd

    pixels, encoded = digit_images(20)
    uri = f"models:/{model}@champion"
    from_bytes, from_arrays = predict_in_fresh_interpreter(
        uri, [pd.DataFrame({"image": encoded}), pd.DataFrame({"image": list(pixels)})], tmp_path)
    assert from_bytes == from_arrays
    assert set(from_bytes) <= {f"digit-{d}" for d in range(10)}


def test_a_user_error_raised_inside_a_rank_fails_train_at_once_without_retries(airflow_db, digits_idx):
    """model.class_names with 3 names for 10 classes: the ranks raise ConfigError; the task fails on its
    first try with that message (no torchrun restart, no Airflow retry), although retries are 2."""
    dag_run = run_dag("image_classifier", {"input_path": str(digits_idx), "variant": "tiny", "model_name": "digits_bad",
                                           "max_restarts": 2, "overrides": {"model.class_names": ["a", "b", "c"]}})
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "failed"
    states = {ti.task_id: (str(ti.state), ti.try_number) for ti in dag_run.get_task_instances()}
    assert states["prepare_data"][0] == "success"
    assert states["train"] == ("failed", 1)
    job = RunInfo("image_classifier", dag_run.run_id).job_dir("train")
    assert [p.name for p in job.glob("logs-try1/torchrun-*")] == ["torchrun-0"]  # launched once: no restart
    reported = json.loads(next((job / "errors").glob("rank-*.json")).read_text())
    assert reported["type"] == "ConfigError" and "model.class_names has 3 names" in reported["message"]
