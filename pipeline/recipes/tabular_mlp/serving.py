"""The registered tabular model (MLflow models-from-code): raw feature rows in, class and probabilities out.

Self-contained: it imports torch, numpy, pandas and mlflow only, never this project, so a model
version loads wherever MLflow does. The network is a ``torch.export`` program (it standardizes numeric inputs
itself); this file adds the categorical vocabularies. Output: ``prediction`` (the class as trained)
and one ``proba_<class>`` column per class.
"""

import json

import mlflow.pyfunc
import numpy as np
import pandas as pd
from mlflow.models import set_model


class TabularClassifier(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        import torch

        with open(context.artifacts["preprocessing"]) as fh:
            self.prep = json.load(fh)
        self.network = torch.export.load(context.artifacts["network"]).module()
        self.code_of = {c: {v: i for i, v in enumerate(vocab)} for c, vocab in self.prep["vocab"].items()}

    def predict(self, context, model_input, params=None):
        import torch

        frame = pd.DataFrame(model_input)
        features = self.prep["numeric_columns"] + self.prep["categorical_columns"]
        missing = [c for c in features if c not in frame]
        if missing:
            raise ValueError(f"input is missing feature column(s) {missing}; the model expects {features}")
        num = frame[self.prep["numeric_columns"]].to_numpy(dtype=np.float32)
        cat = np.zeros((len(frame), len(self.prep["categorical_columns"])), dtype=np.int64)
        for j, column in enumerate(self.prep["categorical_columns"]):
            lookup = self.code_of[column]
            cat[:, j] = [lookup.get(None if pd.isna(v) else str(v), 0) for v in frame[column]]
        with torch.no_grad():
            probabilities = torch.softmax(self.network(torch.from_numpy(num), torch.from_numpy(cat)), dim=1).numpy()
        classes = self.prep["label_classes"]
        out = pd.DataFrame(probabilities, columns=[f"proba_{c}" for c in classes], index=frame.index)
        out.insert(0, "prediction", np.asarray(classes, dtype=object)[probabilities.argmax(axis=1)])
        return out


set_model(TabularClassifier())
