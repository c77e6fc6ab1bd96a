"""The typed hand-offs between tasks (pipeline.results): every result survives JSON as the XCom carries it, a
malformed XCom value fails naming the class, the field and the value, and run_stage converts by annotation."""

import json

import pytest

from pipeline.errors import UserError
from pipeline.results import (
    Approval,
    DatasetSummary,
    Evaluation,
    Gate,
    Interval,
    ModelScore,
    ModelSummary,
    PreparedData,
    Promotion,
    RegisteredModel,
    ResultError,
    TrainedModel,
    TrainingSummary,
    from_xcom_as,
)

PREPARED = PreparedData(
    name="daily", uri="file:///data/daily/v2", version="v2", uris=("file:///data/daily/v1", "file:///data/daily/v2"),
    versions=("v1", "v2"), rows={"train": 800, "val": 100, "test": 100}, bad_rows=3,
    interval=Interval(start="2026-11-27T00:00:00+00:00", end="2026-11-29T00:00:00+00:00"), skipped=True, wall_s=0.0,
)
TRAINED = TrainedModel(
    mlflow_run_id="abc", mlflow_experiment_id="1", mlflow_url="http://mlflow/#/experiments/1/runs/abc",
    model_files={"network": "/runs/x/train/network.pt2"}, metrics={"val_loss": 0.4, "val_accuracy": 0.8},
    world_size=2, backend="gloo", dataset_version="v2", wall_s=12.5, samples_per_s=9000.0,
    baseline_metrics={"test_exact_match": 0.0}, metrics_path="/runs/x/train/metrics.jsonl",
    details={"steps": 40, "resumed_from": None, "throughput": {"samples_per_s": 9000.0}},
)
REGISTERED = RegisteredModel(model_name="m", version="3", created=True, mlflow_run_id="abc", mlflow_experiment_id="1",
                             mlflow_url="http://mlflow/#/models/m/versions/3", wall_s=4.0)
GATE = Gate(passed=False, status="failed", reason="accuracy 0.80 vs champion 0.81",
            primary={"metric": "accuracy", "challenger": 0.8, "champion": 0.81},
            guardrails=({"metric": "log_loss", "held": True},))
EVALUATION = Evaluation(
    challenger=ModelScore(version="3", metrics={"accuracy": 0.8, "rows": 100}),
    champion=ModelScore(version="2", metrics={"accuracy": 0.81, "rows": 100}), champion_not_comparable=None,
    gate=GATE, test_rows=100, report="/runs/x/evaluate/report/report.html",
    mlflow_url="http://mlflow/#/experiments/1/runs/abc/artifacts/evaluation/report.html", wall_s=2.5,
)
APPROVAL = Approval(chosen_options=("Approve",), responded_by_user="admin")
PROMOTION = Promotion(
    dag_id="tabular_mlp", run_id="manual__1", dataset=DatasetSummary(uri=PREPARED.uri, version="v2", rows=PREPARED.rows,
                                                                     reused=True),
    model=ModelSummary(name="m", version="3", aliases=("challenger",), mlflow_run_id="abc"),
    test_metrics={"accuracy": 0.8}, champion_before=EVALUATION.champion, gate=GATE, promoted=False,
    reason="gate failed: accuracy 0.80 vs champion 0.81", report=EVALUATION.report,
    train=TrainingSummary(samples_per_s=None, world_size=2, backend="gloo", final_metrics={"val_loss": 0.4}),
    wall_s={"prepare_data": 0.0, "train": 12.5, "register_model": 4.0, "evaluate": 2.5, "promote": 0.3},
)
EVERY_RESULT = [PREPARED, TRAINED, REGISTERED, EVALUATION, APPROVAL, PROMOTION]


@pytest.mark.parametrize("result", EVERY_RESULT, ids=lambda r: type(r).__name__)
def test_every_result_survives_json_as_the_xcom_carries_it(result):
    value = json.loads(json.dumps(result.to_xcom()))
    assert type(result).from_xcom(value) == result
    assert value == result.to_xcom()  # plain JSON values: nothing json had to convert


def test_the_xcom_shape_stays_readable_with_the_mlflow_link_at_the_top():
    assert TRAINED.to_xcom()["mlflow_url"] == TRAINED.mlflow_url  # MlflowLink.get_link reads it there
    assert EVALUATION.to_xcom()["gate"] == {"passed": False, "status": "failed", "reason": GATE.reason,
                                            "primary": GATE.primary, "guardrails": [{"metric": "log_loss", "held": True}]}
    assert PREPARED.to_xcom()["interval"] == {"start": "2026-11-27T00:00:00+00:00", "end": "2026-11-29T00:00:00+00:00"}
    summary = PROMOTION.to_xcom()
    assert summary["dataset"] == {"uri": PREPARED.uri, "version": "v2", "rows": PREPARED.rows, "reused": True}
    assert summary["model"]["aliases"] == ["challenger"]


def test_a_missing_field_names_the_class_and_the_field():
    value = TRAINED.to_xcom()
    del value["mlflow_run_id"]
    with pytest.raises(ResultError, match=r"TrainedModel: field\(s\) \['mlflow_run_id'\] missing") as err:
        TrainedModel.from_xcom(value)
    assert isinstance(err.value, UserError)  # the task fails without retries: a retry reads the same value


def test_a_wrong_type_names_the_class_the_field_and_the_value():
    with pytest.raises(ResultError, match=r"TrainedModel\.world_size: expected int, got '2' \(str\)"):
        TrainedModel.from_xcom(TRAINED.to_xcom() | {"world_size": "2"})
    with pytest.raises(ResultError, match=r"RegisteredModel\.created: expected bool, got 1 \(int\)"):
        RegisteredModel.from_xcom(REGISTERED.to_xcom() | {"created": 1})
    with pytest.raises(ResultError, match=r"PreparedData\.rows\['test'\]: expected int, got 'many' \(str\)"):
        PreparedData.from_xcom(PREPARED.to_xcom() | {"rows": {"train": 1, "test": "many"}})


def test_a_nested_field_is_named_by_its_path():
    value = EVALUATION.to_xcom()
    value["gate"]["passed"] = "yes"
    with pytest.raises(ResultError, match=r"Evaluation\.gate\.passed: expected bool, got 'yes' \(str\)"):
        Evaluation.from_xcom(value)
    value = EVALUATION.to_xcom()
    del value["challenger"]["metrics"]
    with pytest.raises(ResultError, match=r"Evaluation\.challenger: field\(s\) \['metrics'\] missing"):
        Evaluation.from_xcom(value)


def test_an_unknown_field_or_a_value_that_is_no_object_is_refused():
    with pytest.raises(ResultError, match=r"RegisteredModel: unknown field\(s\) \['versoin'\]"):
        RegisteredModel.from_xcom(REGISTERED.to_xcom() | {"versoin": "3"})
    with pytest.raises(ResultError, match=r"PreparedData: expected an object with the fields of PreparedData, got None"):
        PreparedData.from_xcom(None)


def test_optional_fields_take_none_and_their_defaults():
    value = TRAINED.to_xcom()
    for key in ("samples_per_s", "baseline_metrics", "metrics_path", "details"):
        del value[key]
    trained = TrainedModel.from_xcom(value)
    assert trained.metrics_path is None and trained.baseline_metrics is None and trained.details == {}
    assert Evaluation.from_xcom(EVALUATION.to_xcom() | {"champion": None}).champion is None


def test_a_stage_argument_is_parsed_by_its_annotation():
    assert from_xcom_as(PreparedData, PREPARED.to_xcom(), "train's argument 'dataset'") == PREPARED
    assert from_xcom_as(Approval | None, None, "promote's argument 'approval'") is None
    assert from_xcom_as(dict[str, str], {"MLFLOW_RUN_ID": "x"}, "adopt's argument 'tracked'") == {"MLFLOW_RUN_ID": "x"}
    with pytest.raises(ResultError, match=r"^register_model's argument 'trained': TrainedModel: field\(s\)"):
        from_xcom_as(TrainedModel, {"metrics": {}}, "register_model's argument 'trained'")


def test_run_stage_converts_the_stages_arguments_and_result():
    from pipeline import stages
    from pipeline.airflow.tasks import typed_args

    args = typed_args(stages.promote, (PREPARED.to_xcom(), TRAINED.to_xcom(), REGISTERED.to_xcom(),
                                       EVALUATION.to_xcom(), APPROVAL.to_xcom()))
    assert args == [PREPARED, TRAINED, REGISTERED, EVALUATION, APPROVAL]
    assert typed_args(stages.prepare_data, ({"dataset": "daily", "end": "2026-11-29"},)) == [
        {"dataset": "daily", "end": "2026-11-29"}]


def test_adopt_returns_a_trained_model_with_no_spill_to_replay(tmp_path, monkeypatch):
    from pipeline.recipes import get_recipe
    from pipeline.registry import tracking
    from pipeline.stages.run import RunInfo
    from pipeline.stages.script import adopt

    monkeypatch.setattr(tracking, "experiment_id_of", lambda run_id: "7")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    cfg = get_recipe("llm_sft").config("tiny")
    trained = adopt(cfg, RunInfo("d", "r"), PREPARED, {"MLFLOW_RUN_ID": "run-1"},
                    {"model_dir": str(tmp_path / "model"), "metrics": {"train_loss": 1}, "world_size": 2, "wall_s": 3.0,
                     "epochs": 1})
    assert isinstance(trained, TrainedModel)
    assert trained.metrics_path is None  # the script sent its own metrics: register_model sends nothing
    assert trained.model_files == {"model_dir": str(tmp_path / "model")}
    assert trained.metrics == {"train_loss": 1.0} and trained.world_size == 2 and trained.dataset_version == "v2"
    assert trained.mlflow_experiment_id == "7" and trained.details == {"epochs": 1}
    assert TrainedModel.from_xcom(json.loads(json.dumps(trained.to_xcom()))) == trained
