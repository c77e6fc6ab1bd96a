"""Evaluation of classifiers: a registered model's ``prediction`` / ``proba_<class>`` output scored on
labelled rows, the metrics the gate can use (with directions) and the report's sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pipeline.evaluate.directions import CLASSIFICATION
from pipeline.evaluate.evaluator import predict

PROBA_PREFIX = "proba_"


class ClassificationEvaluator:
    metrics = CLASSIFICATION
    history_keys = ("train_loss", "val_loss", "train_accuracy", "val_accuracy")

    def score(self, model_uri: str, inputs, labels: np.ndarray, cfg=None) -> dict[str, Any]:
        """The registered model's metrics and report details on the split's rows and labels (class indices)."""
        return self.score_output(predict(model_uri, inputs), labels)

    def score_output(self, output, labels: np.ndarray) -> dict[str, Any]:
        """Metrics and report details of one model's output on the split's labels (class indices)."""
        from pipeline.evaluate.metrics import classification_metrics
        from pipeline.evaluate.report import score_details

        probabilities = output[[c for c in output.columns if c.startswith(PROBA_PREFIX)]].to_numpy()
        return {"metrics": classification_metrics(labels, probabilities), "details": score_details(labels, probabilities)}

    def write_report(self, out_dir: Path, **kwargs: Any) -> list[Path]:
        from pipeline.evaluate.report import write_report

        return write_report(out_dir, **kwargs)

    def text_summary(self, classes: list, scored: dict[str, Any], decision: dict[str, Any]) -> str:
        from pipeline.evaluate.report import text_summary

        return text_summary(classes, scored, decision)


EVALUATOR = ClassificationEvaluator()
