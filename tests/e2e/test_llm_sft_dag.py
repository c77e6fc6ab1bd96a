"""The llm_sft DAG and the TRL / Accelerate script DAGs run by Airflow against real torchrun ranks and a real
MLflow store, offline: a tokenizer trained in-process and tiny Llama-style models on two-digit additions."""

import json

import pytest

from pipeline.dev.demo import run_dag
from pipeline.stages.run import RunInfo
from tests.selfcontained import predict_in_fresh_interpreter

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def additions(pipeline_home):
    from pipeline.recipes.llm_sft import demo

    return demo.write_addition(pipeline_home / "inputs" / "llm" / "additions.jsonl", rows=1200)


def _summary(dag_id, dag_run):
    assert str(getattr(dag_run.state, "value", dag_run.state)) == "success"
    return json.loads((RunInfo(dag_id, dag_run.run_id).workdir / "summary.json").read_text())


def test_the_recipe_tokenizes_trains_registers_and_gates_through_the_shared_dag(airflow_db, additions, tmp_path):
    from pipeline.registry.tracking import client

    model = "llm_e2e"
    dag_run = run_dag("llm_sft", {"input_path": str(additions), "variant": "tiny", "model_name": model})
    summary = _summary("llm_sft", dag_run)
    assert summary["train"]["world_size"] == 2 and summary["promoted"]
    assert summary["dataset"]["rows"]["test"] > 50
    metrics = summary["test_metrics"]
    assert set(metrics) >= {"exact_match", "loss", "perplexity"}
    # One tiny epoch: far from solved, but the loss per completion token is far below chance (ln 260 = 5.6).
    assert metrics["loss"] < 4.0 and metrics["perplexity"] < 55, metrics
    assert summary["train"]["baseline_metrics"]["test_exact_match"] == 0.0
    run_id = summary["model"]["mlflow_run_id"]
    history = client().get_metric_history(run_id, "tokens_per_s")
    assert history and history[-1].value > 0
    assert "evaluation/report.html" in {a.path for a in client().list_artifacts(run_id, "evaluation")}
    flavors = json.loads(json.dumps(client().get_model_version(model, summary["model"]["version"]).tags))
    assert flavors["pipeline.recipe"] == "llm_sft"

    # The registered model (mlflow.transformers, text-generation) answers prompts in an interpreter that cannot
    # import this project.
    import pandas as pd

    answers = predict_in_fresh_interpreter(f"models:/{model}@champion", pd.DataFrame({"prompt": ["12+34=", "50+25="]}),
                                           tmp_path)
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)


@pytest.mark.parametrize("dag_id", ["trl_sft_example", "accelerate_sft_example"])
def test_a_toolchain_script_runs_unchanged_and_its_output_goes_through_register_evaluate_and_gate(
        airflow_db, additions, tmp_path, dag_id):
    from pipeline.recipes.llm_sft import demo
    from pipeline.registry.tracking import client

    checkpoint = demo.write_tiny_checkpoint(additions.parent / "tokenizer", tmp_path / "tiny-llama")
    conf = {"input_path": str(additions), "variant": "tiny", "pretrained_path": str(checkpoint),
            "tokenizer_path": str(checkpoint), "overrides": {"data.response_column": "response"}}
    dag_run = run_dag(dag_id, conf)
    summary = _summary(dag_id, dag_run)
    assert summary["model"]["name"] == dag_id and summary["promoted"]
    assert summary["train"]["world_size"] == 2
    assert summary["test_metrics"]["loss"] < 5.0  # trained: an untrained tiny model is near ln(260) = 5.6
    run = client().get_run(summary["model"]["mlflow_run_id"])
    assert "train_loss" in run.data.metrics  # the library's own MLflow integration logged into the DAG's run
