"""The image classifier's hooks for the generic loop, its export and packaging, and its evaluation inputs."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.data.read.training_data import TrainingData
from pipeline.errors import DataError
from pipeline.evaluate.classification import EVALUATOR
from pipeline.recipes.image_classifier.model import SmallResNet
from pipeline.train.export import NETWORK_FILE, export_network
from pipeline.registry.package import ModelPackage
from pipeline.results import TrainedModel
from pipeline.train.spec import TrainSpec

LABELS_FILE = "labels.json"  # classes, their names, the input shape
SERVING = Path(__file__).with_name("serving.py")


def image_column(data: TrainingData) -> str:
    columns = data.schema.get("image_columns") or data.schema.get("array_columns") or []
    if len(columns) != 1:
        raise DataError(f"dataset version(s) {data.versions}: the image classifier needs exactly one image column "
                        f"(PNG/JPEG or a fixed-shape array), found {columns} among {data.schema['columns']}")
    return columns[0]


def input_shape(data: TrainingData) -> tuple[int, int, int]:
    """(channels, height, width) of the dataset's images: from an array column's encoding
    (``ndarray:uint8:28,28``), or by decoding the first training image (PNG/JPEG)."""
    column = image_column(data)
    key = tuple(data.versions)
    if key in _SHAPES:
        return _SHAPES[key]
    encoding = data.schema["encodings"][column]
    if encoding.startswith("ndarray:"):
        shape = tuple(int(n) for n in encoding.rsplit(":", 1)[1].split(","))
    else:
        first = data.shards("train").read(np.arange(1))
        shape = np.asarray(first[column][0]).shape
    if len(shape) not in (2, 3):
        raise DataError(f"column {column!r}: images must be 2-D (gray) or 3-D (H, W, C), got shape {shape}")
    _SHAPES[key] = (1, shape[0], shape[1]) if len(shape) == 2 else (shape[2], shape[0], shape[1])
    return _SHAPES[key]


_SHAPES: dict[tuple[str, ...], tuple[int, int, int]] = {}


def class_names(cfg, data: TrainingData) -> list[str]:
    classes = data.preprocessing["label_classes"]
    names = list(cfg.model.class_names)
    if names and len(names) != len(classes):
        from pipeline.errors import ConfigError

        raise ConfigError(f"model.class_names has {len(names)} names; the data has {len(classes)} classes {classes}")
    return names or [str(c) for c in classes]


def build_model(cfg, data: TrainingData) -> SmallResNet:
    class_names(cfg, data)  # a bad model.class_names fails here, not after training
    channels, _, _ = input_shape(data)
    m = cfg.model
    return SmallResNet(channels=channels, num_classes=len(data.preprocessing["label_classes"]),
                       widths=list(m.widths), depth=m.depth, dropout=m.dropout)


class ToTensors:
    """Decoded columns -> ``pixels`` float32 [B, C, H, W] (0..255) and ``label`` int64 [B] (picklable)."""

    def __init__(self, column: str, label_column: str, classes: list, shape: tuple[int, int, int]):
        self.column, self.label_column, self.shape = column, label_column, tuple(shape)
        self.label_index = {c: i for i, c in enumerate(classes)}

    def __call__(self, columns: dict[str, Any]) -> dict[str, torch.Tensor]:
        pixels = np.asarray(columns[self.column], dtype=np.float32)
        if pixels.ndim == 3:
            pixels = pixels[:, None]
        else:
            pixels = pixels.transpose(0, 3, 1, 2)
        if pixels.shape[1:] != self.shape:
            raise DataError(f"column {self.column!r}: an image of shape {pixels.shape[1:]} (C, H, W); "
                            f"the model is built for {self.shape}")
        try:
            labels = np.array([self.label_index[_plain(v)] for v in columns[self.label_column]], dtype=np.int64)
        except KeyError as exc:
            raise DataError(f"label {exc.args[0]!r} is not one of the classes {list(self.label_index)}") from None
        return {"pixels": torch.from_numpy(np.ascontiguousarray(pixels)), "label": torch.from_numpy(labels)}


def batch_transform(cfg, data: TrainingData, train: bool) -> ToTensors:
    return ToTensors(image_column(data), data.schema["label_column"], data.preprocessing["label_classes"],
                     input_shape(data))


class Augment:
    """Random shifts and rotations of a batch, on its device, from the global torch RNG (which
    checkpoints restore, so a resumed run augments as an uninterrupted one)."""

    def __init__(self, max_shift: float, max_rotation_deg: float):
        self.max_shift, self.max_rotation = max_shift, math.radians(max_rotation_deg)

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        batch = pixels.shape[0]
        angle = (torch.rand(batch) * 2 - 1) * self.max_rotation
        shift = (torch.rand(batch, 2) * 2 - 1) * self.max_shift * 2  # affine_grid spans [-1, 1]: size 2
        cos, sin = torch.cos(angle), torch.sin(angle)
        theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
        grid = F.affine_grid(theta.to(pixels.device, pixels.dtype), list(pixels.shape), align_corners=False)
        return F.grid_sample(pixels, grid, padding_mode="zeros", align_corners=False)


def loss(cfg, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    pixels = batch["pixels"]
    if cfg.model.augment and model.training:
        pixels = Augment(cfg.model.max_shift, cfg.model.max_rotation_deg)(pixels)
    logits = model(pixels)
    return (F.cross_entropy(logits.float(), batch["label"], reduction="sum"),
            {"accuracy": (logits.argmax(1) == batch["label"]).sum()})


def export(cfg, model: SmallResNet, data: TrainingData, out_dir: Path) -> dict[str, str]:
    out_dir = Path(out_dir)
    channels, height, width = input_shape(data)
    export_network(model, (torch.zeros(2, channels, height, width),), out_dir / NETWORK_FILE)
    (out_dir / LABELS_FILE).write_text(json.dumps({
        "classes": [_plain(c) for c in data.preprocessing["label_classes"]], "names": class_names(cfg, data),
        "channels": channels, "height": height, "width": width,
    }, indent=2))
    return {"network": str(out_dir / NETWORK_FILE), "labels": str(out_dir / LABELS_FILE)}


def package(cfg, trained: TrainedModel, data: TrainingData) -> ModelPackage:
    files = trained.model_files
    inputs, _ = evaluation_inputs(cfg, data, "test", limit=3)
    return ModelPackage(python_model=str(SERVING), artifacts={"network": files["network"], "labels": files["labels"]},
                        input_example=inputs, pip_requirements=[])


def evaluation_inputs(cfg, data: TrainingData, split: str, limit: int | None = None):
    """The split's images as PNG bytes in an ``image`` column (what a client sends) and label indices."""
    import pandas as pd
    from PIL import Image

    columns = data.read_split(split)
    images = np.asarray(columns[image_column(data)])[:limit]
    encoded = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(np.asarray(image, dtype=np.uint8)).save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    index = {c: i for i, c in enumerate(data.preprocessing["label_classes"])}
    labels = np.array([index[_plain(v)] for v in columns[data.schema["label_column"]][:limit]], dtype=np.int64)
    return pd.DataFrame({"image": encoded}), labels


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


SPEC = TrainSpec(build_model=build_model, batch_transform=batch_transform, loss=loss, export=export,
                 package=package, evaluation_inputs=evaluation_inputs, evaluator=EVALUATOR)
