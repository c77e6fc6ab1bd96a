"""The registered two-tower model (MLflow models-from-code): user rows in, each user's top-k items out.

Self-contained: it imports torch, numpy, pandas and mlflow only, never this project. Input rows carry
the user id and the user features the model was trained with (an unknown id or category falls back to
the unknown embedding), and, for a model trained with ``model.history_length``, ``history``: the user's recent
item ids, oldest first. The user tower (a ``torch.export`` program) embeds them; every catalogue item
is scored (exact inner products with the item embeddings logged beside it); the output has, per row,
``item_ids`` (best first) and their ``scores``. k is the request's ``k`` parameter, by default ``model.top_k``
of the training run.
"""

import json

import mlflow.pyfunc
import numpy as np
import pandas as pd
from mlflow.models import set_model


class TwoTowerRetriever(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        import torch

        with open(context.artifacts["users"]) as fh:
            self.users = json.load(fh)
        catalogue = np.load(context.artifacts["catalogue"], allow_pickle=False)
        self.item_ids = catalogue["ids"]
        self.item_embeddings = torch.from_numpy(catalogue["embeddings"])
        self.network = torch.export.load(context.artifacts["network"]).module()
        self.code_of = {c: {v: i for i, v in enumerate(vocab)} for c, vocab in self.users["vocab"].items()}
        self.history_code = {v: i for i, v in enumerate(self.users.get("history_vocab", []))}

    def history_codes(self, frame):
        """The rows' ``history`` (recent item ids, oldest first; unknown ones skipped) as the last history_length
        item codes, 0-padded in front."""
        length = int(self.users["history_length"])
        out = np.zeros((len(frame), length), dtype=np.int64)
        for row, items in enumerate(frame["history"]):
            codes = [self.history_code[str(i)] for i in (() if items is None else items) if str(i) in self.history_code]
            codes = codes[-length:]
            out[row, length - len(codes):] = codes
        return out

    def predict(self, context, model_input, params=None):
        import torch

        frame = pd.DataFrame(model_input)
        u = self.users
        expected = [u["id_column"], *u["categorical_columns"], *u["numeric_columns"]] + (
            ["history"] if u.get("history_length") else [])
        missing = [c for c in expected if c not in frame]
        if missing:
            raise ValueError(f"input is missing column(s) {missing}; the model expects {expected}")

        def codes(column):
            lookup = self.code_of[column]
            return np.array([lookup.get(None if pd.isna(v) else str(v), 0) for v in frame[column]], dtype=np.int64)

        ids = torch.from_numpy(codes(u["id_column"]))
        cat = torch.from_numpy(np.stack([codes(c) for c in u["categorical_columns"]], axis=1).reshape(len(frame), -1))
        num = torch.from_numpy(frame[u["numeric_columns"]].to_numpy(dtype=np.float32).reshape(len(frame), -1))
        inputs = [ids, cat, num]
        if u.get("history_length"):
            inputs.append(torch.from_numpy(self.history_codes(frame)))
        k = min(int((params or {}).get("k") or u["top_k"]), len(self.item_ids))
        with torch.no_grad():
            scores = self.network(*inputs) @ self.item_embeddings.T
            top = torch.topk(scores, k, dim=1)
        return pd.DataFrame({
            "item_ids": [self.item_ids[row].tolist() for row in top.indices.numpy()],
            "scores": [row.tolist() for row in top.values.numpy()],
        }, index=frame.index)


set_model(TwoTowerRetriever())
