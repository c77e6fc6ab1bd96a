"""Classification metrics from labels and predicted probabilities (numpy only)."""

from __future__ import annotations

import numpy as np

HIGHER_IS_BETTER = {"accuracy": True, "macro_f1": True, "log_loss": False}


def classification_metrics(labels: np.ndarray, probabilities: np.ndarray) -> dict[str, float]:
    """Accuracy, macro F1 over the classes, log-loss, and the majority-class rate as a baseline."""
    labels = np.asarray(labels, dtype=np.int64)
    num_classes = probabilities.shape[1]
    predicted = probabilities.argmax(axis=1)
    f1s = []
    for k in range(num_classes):
        tp = np.sum((predicted == k) & (labels == k))
        fp = np.sum((predicted == k) & (labels != k))
        fn = np.sum((predicted != k) & (labels == k))
        denominator = 2 * tp + fp + fn
        f1s.append(2 * tp / denominator if denominator else 0.0)
    picked = np.clip(probabilities[np.arange(len(labels)), labels], 1e-15, 1.0)
    counts = np.bincount(labels, minlength=num_classes)
    return {
        "accuracy": float(np.mean(predicted == labels)),
        "macro_f1": float(np.mean(f1s)),
        "log_loss": float(-np.mean(np.log(picked))),
        "majority_rate": float(counts.max() / max(len(labels), 1)),
        "rows": float(len(labels)),
    }
