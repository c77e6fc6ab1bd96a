"""The registered artefact: a pyfunc that scores raw feature rows, wrapping the mlflow.pytorch model.

The torch module standardizes numeric inputs itself; the pyfunc adds what torch cannot hold -
the categorical vocabularies - so ``models:/NAME@ALIAS`` takes the same rows as the input Parquet.
"""

from __future__ import annotations

import json
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd

PROBA_PREFIX = "proba_"


class TabularClassifier(mlflow.pyfunc.PythonModel):
    """Raw rows in; ``prediction`` and one ``proba_<class>`` column per class out."""

    def load_context(self, context) -> None:
        import mlflow.pytorch

        with open(context.artifacts["preprocessing"]) as fh:
            self.prep = json.load(fh)
        self.module = mlflow.pytorch.load_model(context.artifacts["torch_model"], map_location="cpu")
        self.module.eval()
        self.code_of = {c: {v: i for i, v in enumerate(vocab)} for c, vocab in self.prep["vocab"].items()}

    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        probabilities = self.predict_proba(model_input)
        classes = self.prep["label_classes"]
        out = pd.DataFrame(probabilities, columns=[f"{PROBA_PREFIX}{c}" for c in classes], index=model_input.index)
        out.insert(0, "prediction", np.asarray(classes, dtype=object)[probabilities.argmax(axis=1)])
        return out

    def predict_proba(self, frame: pd.DataFrame) -> np.ndarray:
        import torch

        missing = [c for c in self.prep["numeric_columns"] + self.prep["categorical_columns"] if c not in frame]
        if missing:
            raise ValueError(f"input is missing feature column(s) {missing}; the model expects "
                             f"{self.prep['numeric_columns'] + self.prep['categorical_columns']}")
        num = frame[self.prep["numeric_columns"]].to_numpy(dtype=np.float32)
        cat = np.zeros((len(frame), len(self.prep["categorical_columns"])), dtype=np.int64)
        for j, column in enumerate(self.prep["categorical_columns"]):
            lookup = self.code_of[column]
            cat[:, j] = [lookup.get(None if pd.isna(v) else str(v), 0) for v in frame[column]]
        with torch.no_grad():
            logits = self.module(torch.from_numpy(num), torch.from_numpy(cat))
            return torch.softmax(logits, dim=1).numpy()
