"""Evaluation of classifiers: a registered model's ``prediction`` / ``proba_<class>`` output scored on
labelled rows beside the majority-class baseline, the metrics the gate can use (with directions) and the
report's sections."""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.evaluate.directions import CLASSIFICATION
from pipeline.evaluate.evaluator import predict

PROBA_PREFIX = "proba_"


def score_details(labels: np.ndarray, probabilities: np.ndarray) -> dict[str, Any]:
    """What the report shows about one model on the test split: per-class figures, the confusion matrix, the
    binary curves; and the baseline's metrics: the split's class frequencies as every row's prediction (its
    majority class, with the log loss of those frequencies)."""
    from pipeline.evaluate.metrics import binary_curves, classification_metrics, confusion_matrix, per_class

    labels = np.asarray(labels, dtype=np.int64)
    num_classes = probabilities.shape[1]
    prior = np.bincount(labels, minlength=num_classes) / max(len(labels), 1)
    details: dict[str, Any] = {
        "per_class": per_class(labels, probabilities),
        "confusion": confusion_matrix(labels, probabilities.argmax(axis=1), num_classes).tolist(),
        "baseline": classification_metrics(labels, np.tile(prior, (len(labels), 1))),
    }
    if num_classes == 2:
        details["curves"] = binary_curves(labels, probabilities[:, 1])
    return details


class ClassificationEvaluator:
    metrics = CLASSIFICATION
    history_keys = ("train_loss", "val_loss", "train_accuracy", "val_accuracy")
    baseline = "majority class"

    def score(self, model_uri: str, inputs, labels: np.ndarray, cfg=None) -> dict[str, Any]:
        """The registered model's metrics and report details on the split's rows and labels (class indices)."""
        return self.score_output(predict(model_uri, inputs), labels)

    def score_output(self, output, labels: np.ndarray) -> dict[str, Any]:
        """Metrics and report details of one model's output on the split's labels (class indices)."""
        from pipeline.evaluate.metrics import classification_metrics

        probabilities = output[[c for c in output.columns if c.startswith(PROBA_PREFIX)]].to_numpy()
        return {"metrics": classification_metrics(labels, probabilities), "details": score_details(labels, probabilities)}

    def report_sections(self, classes: list, scored: dict[str, Any], history) -> list:
        from pipeline.evaluate import classification_plots as plots
        from pipeline.evaluate.report.document import Section, role_labels
        from pipeline.evaluate.report.plots import training_curves

        labels = role_labels(scored)
        details = {role: scored[role]["details"] for role in labels}
        matrices = {role: np.asarray(d["confusion"], dtype=np.int64) for role, d in details.items()}
        names = [str(c) for c in classes] or [str(k) for k in range(len(matrices["challenger"]))]
        per_class = {role: d["per_class"] for role, d in details.items()}
        confusion: tuple = (plots.confusion_plot(names, matrices, labels),)
        if len(names) > 2:
            confusion += (plots.top_confusions(names, matrices, labels),)
        sections = [Section("Confusion matrices", confusion),
                    Section("Per class", (plots.per_class_f1_plot(names, per_class, labels),
                                          plots.per_class_table(names, per_class, labels)))]
        if all("curves" in d for d in details.values()):
            support = [row["support"] for row in per_class["challenger"]]
            sections.append(Section("ROC and precision-recall", (plots.roc_pr_plot(
                {role: d["curves"] for role, d in details.items()}, labels, names[1], support[1] / max(sum(support), 1)),)))
        curves = training_curves(history, labels)
        if curves is not None:
            sections.append(Section("Training", (curves,)))
        return sections


EVALUATOR = ClassificationEvaluator()
