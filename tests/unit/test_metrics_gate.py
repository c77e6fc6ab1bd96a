import numpy as np
import pytest

from pipeline.evaluate.gate import decide
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


def test_gate_promotes_without_a_champion_and_within_tolerance():
    assert decide("accuracy", {"accuracy": 0.5}, None, 0.01).promote
    assert decide("accuracy", {"accuracy": 0.795}, {"accuracy": 0.80}, 0.01).promote
    worse = decide("accuracy", {"accuracy": 0.70}, {"accuracy": 0.80}, 0.01)
    assert not worse.promote and "worse by 0.1000" in worse.reason


def test_gate_respects_the_metric_direction():
    assert not decide("log_loss", {"log_loss": 0.9}, {"log_loss": 0.5}, 0.05).promote
    assert decide("log_loss", {"log_loss": 0.4}, {"log_loss": 0.5}, 0.0).promote
