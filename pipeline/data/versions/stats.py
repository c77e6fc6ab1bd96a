"""Mergeable sufficient statistics of a dataset version, and the preprocessing the model is built from.

Each version stores counts, means and sums of squared deviations of its training split's numeric
features, its training split's category counts and its label counts. Statistics of several versions
(a window of intervals) merge exactly, so a model trained on a window standardizes with the window's
mean and std and embeds the window's vocabularies, whatever the versions held one by one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

UNKNOWN = "<unk>"  # code 0 of every vocabulary: unseen or missing categories
MISSING = ""  # a null category is stored as the empty string, and encodes as UNKNOWN


@dataclass
class Stats:
    numeric_columns: list[str]
    categorical_columns: list[str]
    label_kind: str  # "int" or "str"
    count: int = 0  # training rows
    mean: np.ndarray = None  # type: ignore[assignment]
    m2: np.ndarray = None  # type: ignore[assignment]  sum of squared deviations from the mean
    categories: dict[str, Counter] = field(default_factory=dict)
    labels: Counter = field(default_factory=Counter)  # every split: classes may be rare

    def __post_init__(self):
        k = len(self.numeric_columns)
        self.mean = np.zeros(k) if self.mean is None else np.asarray(self.mean, dtype=np.float64)
        self.m2 = np.zeros(k) if self.m2 is None else np.asarray(self.m2, dtype=np.float64)
        for name in self.categorical_columns:
            self.categories.setdefault(name, Counter())

    def add_numeric(self, values: np.ndarray) -> None:
        """Fold in a [rows, features] float64 block of training rows."""
        if len(values):
            self._merge_moments(len(values), values.mean(axis=0), ((values - values.mean(axis=0)) ** 2).sum(axis=0))

    def _merge_moments(self, n: int, mean: np.ndarray, m2: np.ndarray) -> None:
        # Chan et al.'s pairwise update: exact, and stable where sum/sum-of-squares would cancel.
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.count * n / total)
        self.count = total

    def merge(self, other: Stats) -> Stats:
        if (other.numeric_columns, other.categorical_columns, other.label_kind) != (
                self.numeric_columns, self.categorical_columns, self.label_kind):
            raise ValueError("statistics of different schemas cannot merge")
        if other.count:
            self._merge_moments(other.count, other.mean, other.m2)
        for name, counts in other.categories.items():
            self.categories[name].update(counts)
        self.labels.update(other.labels)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "numeric_columns": self.numeric_columns, "categorical_columns": self.categorical_columns,
            "label_kind": self.label_kind, "count": self.count, "mean": self.mean.tolist(), "m2": self.m2.tolist(),
            "categories": {k: dict(sorted(v.items())) for k, v in self.categories.items()},
            # JSON keys are text: int labels are restored from label_kind.
            "labels": {str(k): v for k, v in sorted(self.labels.items())},
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Stats:
        to_label = int if raw["label_kind"] == "int" else str
        return cls(
            numeric_columns=list(raw["numeric_columns"]), categorical_columns=list(raw["categorical_columns"]),
            label_kind=raw["label_kind"], count=raw["count"], mean=raw["mean"], m2=raw["m2"],
            categories={k: Counter(v) for k, v in raw["categories"].items()},
            labels=Counter({to_label(k): v for k, v in raw["labels"].items()}),
        )

    def preprocessing(self, declared_classes: list[str] | None = None) -> dict[str, Any]:
        """What the model is built for: columns, vocabularies, mean/std, label classes."""
        n = max(self.count, 1)
        if declared_classes:
            to_label = int if self.label_kind == "int" else str
            classes = sorted(to_label(c) for c in declared_classes)
        else:
            classes = sorted(self.labels)
        return {
            "numeric_columns": self.numeric_columns,
            "categorical_columns": self.categorical_columns,
            "vocab": {name: [UNKNOWN] + sorted(c for c in self.categories[name] if c != MISSING)
                      for name in self.categorical_columns},
            "mean": self.mean.tolist(),
            "std": np.sqrt(self.m2 / n).tolist(),
            "label_classes": classes,
        }
