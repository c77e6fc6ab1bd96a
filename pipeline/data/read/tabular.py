"""Tabular encoding with one window's preprocessing: raw samples or decoded columns -> the model's numeric,
categorical and label arrays (``Encoder``), and the frame of raw rows a tabular model scores (``feature_frame``).
The tabular and two-tower recipes use it."""

from __future__ import annotations

from itertools import repeat
from typing import Any

import numpy as np

from pipeline.errors import DataError


def feature_frame(columns: dict[str, Any], preprocessing: dict[str, Any]):
    """Numeric and categorical feature columns as the DataFrame of raw rows a tabular model scores."""
    import pandas as pd

    frame = pd.DataFrame({c: np.asarray(columns[c], dtype=np.float64) for c in preprocessing["numeric_columns"]})
    for c in preprocessing["categorical_columns"]:
        # A missing category is stored as "", and scored as one (the model's unknown code).
        frame[c] = pd.Series([v or None for v in columns[c]], dtype=object)
    return frame


class Encoder:
    """Raw samples -> model inputs, with one window's vocabularies and label classes."""

    def __init__(self, preprocessing: dict[str, Any], label_column: str):
        self.numeric = preprocessing["numeric_columns"]
        self.categorical = preprocessing["categorical_columns"]
        self.code_of = {c: {v: i for i, v in enumerate(preprocessing["vocab"][c])} for c in self.categorical}
        self.label_column = label_column
        self.label_index = {label: i for i, label in enumerate(preprocessing["label_classes"])}

    def encode(self, samples: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # np.array copies, so the tensors own writable memory (streaming hands out read-only views).
        num = np.array([[s[c] for c in self.numeric] for s in samples], dtype=np.float32).reshape(len(samples), len(self.numeric))
        cat = np.array([[self.code_of[c].get(s[c], 0) for c in self.categorical] for s in samples],
                       dtype=np.int64).reshape(len(samples), len(self.categorical))
        try:
            label = np.array([self.label_index[_label(s[self.label_column])] for s in samples], dtype=np.int64)
        except KeyError as exc:
            raise DataError(f"label {exc.args[0]!r} is not one of the classes {list(self.label_index)}") from None
        return num, cat, label

    def encode_columns(self, columns: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decoded columns (``decode_columns``) -> ``num`` float32 [B, F], ``cat`` int64 [B, C], ``label`` int64 [B]
        (empty without a label column)."""
        rows = len(columns[self.label_column] if self.label_column else next(iter(columns.values())))
        num = np.empty((rows, len(self.numeric)), dtype=np.float32)
        for j, c in enumerate(self.numeric):
            num[:, j] = columns[c]
        cat = np.zeros((rows, len(self.categorical)), dtype=np.int64)
        # tolist() gives Python values, as _label does, at a tenth of the cost of a call per value; map()
        # looks them up without a bytecode loop (half a list comprehension's time).
        for j, c in enumerate(self.categorical):
            cat[:, j] = np.fromiter(map(self.code_of[c].get, np.asarray(columns[c]).tolist(), repeat(0)),
                                    np.int64, rows)
        if not self.label_column:  # data without labels
            return num, cat, np.zeros(0, np.int64)
        try:
            label = np.fromiter(map(self.label_index.__getitem__, np.asarray(columns[self.label_column]).tolist()),
                                np.int64, rows)
        except KeyError as exc:
            raise DataError(f"label {exc.args[0]!r} is not one of the classes {list(self.label_index)}") from None
        return num, cat, label


def _label(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value
