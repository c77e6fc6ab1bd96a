"""The tabular MLP's hooks for the generic loop, its export and packaging, and its evaluation inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.data.read.training_data import Encoder, TrainingData, feature_frame
from pipeline.evaluate.classification import EVALUATOR
from pipeline.recipes.tabular_mlp.model import ModelSpec, TabularMLP
from pipeline.train.export import NETWORK_FILE, export_network
from pipeline.registry.package import ModelPackage
from pipeline.results import TrainedModel
from pipeline.train.spec import TrainSpec

PREPROCESSING_FILE = "preprocessing.json"
SERVING = Path(__file__).with_name("serving.py")


def build_model(cfg, data: TrainingData) -> TabularMLP:
    prep = data.preprocessing
    spec = ModelSpec(
        num_numeric=len(prep["mean"]), cardinalities=[len(prep["vocab"][c]) for c in prep["categorical_columns"]],
        num_classes=len(prep["label_classes"]), hidden_sizes=list(cfg.model.hidden_sizes), dropout=cfg.model.dropout,
    )
    return TabularMLP(spec, prep["mean"], prep["std"])


class Encode:
    """Decoded columns -> ``num`` float32 [B, F], ``cat`` int64 [B, C], ``label`` int64 [B] (picklable)."""

    def __init__(self, preprocessing: dict[str, Any], label_column: str):
        self.encoder = Encoder(preprocessing, label_column)

    def __call__(self, columns: dict[str, Any]) -> dict[str, torch.Tensor]:
        num, cat, label = self.encoder.encode_columns(columns)
        return {"num": torch.from_numpy(num), "cat": torch.from_numpy(cat), "label": torch.from_numpy(label)}


def batch_transform(cfg, data: TrainingData, train: bool) -> Encode:
    return Encode(data.preprocessing, data.schema["label_column"])


def loss(cfg, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(batch["num"], batch["cat"])
    return (F.cross_entropy(logits.float(), batch["label"], reduction="sum"),
            {"accuracy": (logits.argmax(1) == batch["label"]).sum()})


def export(cfg, model: TabularMLP, data: TrainingData, out_dir: Path) -> dict[str, str]:
    spec = model.spec
    example = (torch.zeros(2, spec.num_numeric), torch.zeros(2, len(spec.cardinalities), dtype=torch.int64))
    export_network(model, example, out_dir / NETWORK_FILE)
    data.write_preprocessing(out_dir / PREPROCESSING_FILE)
    return {"network": str(out_dir / NETWORK_FILE), "preprocessing": str(out_dir / PREPROCESSING_FILE)}


def package(cfg, trained: TrainedModel, data: TrainingData) -> ModelPackage:
    # The preprocessing the model was trained with (the merged one of every version read), as training wrote it.
    prep = data.preprocessing
    example = {c: [row[c] for row in data.sample_rows] for c in prep["numeric_columns"] + prep["categorical_columns"]}
    return ModelPackage(python_model=str(SERVING), artifacts=dict(trained.model_files),
                        input_example=feature_frame(example, prep))


def evaluation_inputs(cfg, data: TrainingData, split: str):
    """The split as raw feature rows (what the registered model scores) and label indices."""
    return data.frame(split)


SPEC = TrainSpec(build_model=build_model, batch_transform=batch_transform, loss=loss, export=export,
                 package=package, evaluation_inputs=evaluation_inputs, evaluator=EVALUATOR)
