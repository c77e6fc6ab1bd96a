"""Classification metrics from labels and predicted probabilities (numpy; curves from scikit-learn)."""

from __future__ import annotations

import numpy as np



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


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """Rows are true classes, columns predicted classes."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (np.asarray(labels, dtype=np.int64), np.asarray(predicted, dtype=np.int64)), 1)
    return matrix


def per_class(labels: np.ndarray, probabilities: np.ndarray) -> list[dict[str, float]]:
    """Precision, recall, F1 and support of each class, in class-index order."""
    matrix = confusion_matrix(labels, probabilities.argmax(axis=1), probabilities.shape[1])
    rows = []
    for k in range(matrix.shape[0]):
        tp = matrix[k, k]
        precision = tp / matrix[:, k].sum() if matrix[:, k].sum() else 0.0
        recall = tp / matrix[k, :].sum() if matrix[k, :].sum() else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        rows.append({"precision": float(precision), "recall": float(recall), "f1": float(f1),
                     "support": int(matrix[k, :].sum())})
    return rows


def binary_curves(labels: np.ndarray, positive_scores: np.ndarray) -> dict[str, np.ndarray | float]:
    """ROC and precision-recall curves of a binary task (class 1 positive), with their areas.

    scikit-learn's: tied scores form one threshold, so their order in the input cannot change the areas.
    """
    from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score, roc_curve

    labels = np.asarray(labels, dtype=np.int64)
    both = len(np.unique(labels)) == 2  # the areas are undefined with one class only
    fpr, tpr, _ = roc_curve(labels, positive_scores, pos_label=1) if both else (np.array([0.0, 1.0]),) * 2 + (None,)
    precision, recall, _ = precision_recall_curve(labels, positive_scores, pos_label=1)
    return {
        "fpr": fpr, "tpr": tpr, "roc_auc": float(roc_auc_score(labels, positive_scores)) if both else float("nan"),
        "precision": precision, "recall": recall,
        "average_precision": float(average_precision_score(labels, positive_scores)) if both else float("nan"),
    }
