import json

import numpy as np
import pytest

from pipeline.evaluate.directions import CLASSIFICATION
from pipeline.evaluate.gate import decide, not_comparable
from pipeline.evaluate.metrics import classification_metrics


def test_metrics_on_a_known_case():
    labels = np.array([0, 0, 1, 2])
    probabilities = np.array([[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]])
    m = classification_metrics(labels, probabilities)
    assert m["accuracy"] == pytest.approx(0.75)
    # class 0: tp1 fn1 -> f1 2/3; class 1: tp1 fp1 -> 2/3; class 2: 1
    assert m["macro_f1"] == pytest.approx((2 / 3 + 2 / 3 + 1) / 3)
    assert m["log_loss"] == pytest.approx(-np.mean(np.log([0.8, 0.2, 0.8, 0.8])))
    assert m["majority_rate"] == pytest.approx(0.5)


def _cfg(**overrides):
    from pipeline.config import PipelineConfig

    return PipelineConfig().with_overrides({f"evaluate.{k}": v for k, v in overrides.items()}).evaluate


def _m(accuracy, macro_f1=0.5, log_loss=0.7):
    return {"accuracy": accuracy, "macro_f1": macro_f1, "log_loss": log_loss}


def test_gate_passes_without_a_champion():
    decision = decide(_cfg(), _m(0.5), None, CLASSIFICATION)
    assert decision.passed and decision.tags()["validation_status"] == "passed"


def test_gate_primary_metric_needs_the_minimum_improvement():
    assert decide(_cfg(min_improvement=-0.01), _m(0.795), _m(0.80), CLASSIFICATION).passed
    strict = decide(_cfg(min_improvement=0.02), _m(0.81), _m(0.80), CLASSIFICATION)
    assert not strict.passed
    assert strict.primary["improvement"] == pytest.approx(0.01)
    assert "gain +0.0100 < required +0.0200" in strict.reason
    assert strict.tags()["validation_status"] == "failed"


def test_gate_guardrails_block_a_regression_elsewhere():
    decision = decide(_cfg(guardrails=["macro_f1", "log_loss"], guardrail_tolerance=0.02),
                      _m(0.85, macro_f1=0.60, log_loss=0.75), _m(0.80, macro_f1=0.70, log_loss=0.70), CLASSIFICATION)
    assert not decision.passed
    held = {g["metric"]: g["held"] for g in decision.guardrails}
    assert held == {"macro_f1": False, "log_loss": False}
    assert "guardrail macro_f1 regressed by 0.1000" in decision.reason
    assert json.loads(decision.tags()["validation.guardrails"])[0]["metric"] == "macro_f1"


def test_gate_respects_the_metric_direction():
    assert not decide(_cfg(metric="log_loss", guardrails=[]), _m(0.8, log_loss=0.9), _m(0.8, log_loss=0.5), CLASSIFICATION).passed
    assert decide(_cfg(metric="log_loss", guardrails=[], min_improvement=0.05), _m(0.8, log_loss=0.4), _m(0.8, log_loss=0.5), CLASSIFICATION).passed


def test_report_has_plots_tables_and_both_models(tmp_path):
    from pipeline.evaluate.classification import EVALUATOR, score_details
    from pipeline.evaluate.report import build_report, write_report

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 200)
    good = np.clip(labels * 0.6 + rng.uniform(0, 0.4, 200), 0, 1)
    bad = rng.uniform(0, 1, 200)
    scored = {}
    for role, p1, version in (("challenger", good, "2"), ("champion", bad, "1")):
        probabilities = np.stack([1 - p1, p1], axis=1)
        scored[role] = {"version": version, "metrics": classification_metrics(labels, probabilities),
                        "details": score_details(labels, probabilities)}
    assert scored["challenger"]["details"]["curves"]["roc_auc"] > 0.95
    assert 0.35 < scored["champion"]["details"]["curves"]["roc_auc"] < 0.65
    decision = decide(_cfg(), scored["challenger"]["metrics"], scored["champion"]["metrics"], CLASSIFICATION).to_dict()
    report = build_report(EVALUATOR, model_name="m", classes=["no", "yes"], scored=scored, decision=decision,
                          history={"challenger": {"train_loss": [(1, 0.9), (2, 0.5)]}})
    files = write_report(report, tmp_path)
    assert sorted(f.name for f in files) == ["confusion_matrix.png", "metrics.json", "per_class_f1.png", "report.html",
                                             "roc_pr.png", "training_curves.png"]
    assert all(f.read_bytes()[:4] == b"\x89PNG" for f in files if f.suffix == ".png")
    page = (tmp_path / "report.html").read_text()
    assert "challenger v2" in page and "champion v1" in page and page.count("data:image/png;base64,") == 4
    text = report.text()
    assert "accuracy" in text and "gate: passed" in text


def test_binary_curves_on_a_known_ranking():
    from pipeline.evaluate.metrics import binary_curves

    curves = binary_curves(np.array([1, 1, 0, 0]), np.array([0.9, 0.8, 0.3, 0.1]))
    assert curves["roc_auc"] == pytest.approx(1.0)
    assert curves["average_precision"] == pytest.approx(1.0)
    mixed = binary_curves(np.array([1, 0, 1, 0]), np.array([0.9, 0.8, 0.3, 0.1]))
    assert mixed["roc_auc"] == pytest.approx(0.75)


@pytest.mark.parametrize("labels, expected", [([1, 0], 0.5), ([0, 1], 0.5), ([1, 1, 0, 0], 0.5)])
def test_roc_auc_and_average_precision_do_not_depend_on_the_order_of_tied_scores(labels, expected):
    from pipeline.evaluate.metrics import binary_curves

    tied = np.full(len(labels), 0.7)
    curves = binary_curves(np.array(labels), tied)
    assert curves["roc_auc"] == pytest.approx(expected)
    assert curves["average_precision"] == pytest.approx(np.mean(labels))


def test_binary_curves_agree_with_a_hand_computed_case():
    from pipeline.evaluate.metrics import binary_curves

    curves = binary_curves(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8]))
    assert curves["roc_auc"] == pytest.approx(0.75)
    assert curves["average_precision"] == pytest.approx((1 + 2 / 3) / 2)


def test_a_champion_that_is_not_comparable_fails_the_gate_with_the_reason():
    decision = not_comparable("champion version 3 takes inputs ['a'], challenger version 4 takes ['b']")
    assert not decision.passed
    assert decision.tags()["validation.reason"].startswith("champion not comparable: champion version 3")
