"""What training and evaluation read: one or more dataset versions as the streams of one StreamingDataset.

Versions store raw values; their statistics merge into the preprocessing of the whole window
(vocabularies, mean/std, label classes), and ``collate`` encodes categories and labels with it. So a
window of daily versions reads as one dataset, whatever vocabulary each day had on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data import local_path
from pipeline.data.prep import read_manifest, read_stats
from pipeline.errors import DataError


@dataclass
class TrainingData:
    """The dataset versions a training run reads, with the encoding the model is built for."""

    dirs: list[Path]
    manifests: list[dict[str, Any]]
    preprocessing: dict[str, Any]
    cache_dir: Path

    @classmethod
    def open(cls, datasets: list[str], cache_dir: Path) -> "TrainingData":
        if isinstance(datasets, (str, Path)):
            datasets = [str(datasets)]
        if not datasets:
            raise DataError("no dataset versions to read: expected at least one dataset URI")
        dirs = [local_path(str(uri)) for uri in datasets]
        manifests = []
        for d in dirs:
            try:
                manifests.append(read_manifest(d))
            except FileNotFoundError:
                raise DataError(f"{d}: no published dataset version here (no manifest.json)") from None
        first = manifests[0]
        for d, m in zip(dirs[1:], manifests[1:]):
            # The columns, their roles and encodings must agree; the input format may differ.
            if _columns(m) != _columns(first):
                raise DataError(
                    f"{d}: version {m['version']} has columns {m['schema']['encodings']}, version "
                    f"{first['version']} has {first['schema']['encodings']}; a window reads versions of one schema"
                )
        stats = read_stats(dirs[0])
        for d in dirs[1:]:
            stats.merge(read_stats(d))
        declared = first["config"].get("label_classes") or None
        return cls(dirs=dirs, manifests=manifests, preprocessing=stats.preprocessing(declared), cache_dir=Path(cache_dir))

    @property
    def versions(self) -> list[str]:
        return [m["version"] for m in self.manifests]

    @property
    def schema(self) -> dict[str, Any]:
        return self.manifests[0]["schema"]

    @property
    def sample_rows(self) -> list[dict[str, Any]]:
        return self.manifests[-1]["sample_rows"]

    def rows(self, split: str) -> int:
        return sum(m["splits"][split] for m in self.manifests)

    def write_preprocessing(self, path: Path) -> Path:
        """The window's preprocessing as a file (what the registered model carries)."""
        import json

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.preprocessing, indent=2))
        return path

    def dataset(self, split: str, *, shuffle: bool, seed: int, batch_size: int | None = None):
        from streaming import Stream, StreamingDataset

        # Each published version is one stream's remote; each job gets its own local cache: two jobs
        # reading one version at once would otherwise collide on streaming's per-directory shared memory.
        streams = [
            Stream(remote=str(d / split), local=str(self.cache_dir / m["version"] / split))
            for d, m in zip(self.dirs, self.manifests) if m["splits"][split]
        ]
        if not streams:
            raise DataError(f"split {split!r} has no rows in dataset version(s) {self.versions}")
        return StreamingDataset(streams=streams, split=None, shuffle=shuffle, shuffle_seed=seed, batch_size=batch_size)

    @cached_property
    def encoder(self) -> "Encoder":
        return Encoder(self.preprocessing, self.schema["label_column"])

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """Samples -> tensors ``num`` float32 [B, F], ``cat`` int64 [B, C], ``label`` int64 [B]."""
        import torch

        num, cat, label = self.encoder.encode(samples)
        return {"num": torch.from_numpy(num), "cat": torch.from_numpy(cat), "label": torch.from_numpy(label)}

    def frame(self, split: str):
        """A split as raw feature rows (what the registered model scores) and label indices."""
        import pandas as pd

        dataset = self.dataset(split, shuffle=False, seed=0)
        samples = [dataset[i] for i in range(dataset.num_samples)]
        prep = self.preprocessing
        frame = pd.DataFrame({c: np.asarray([s[c] for s in samples], dtype=np.float64) for c in prep["numeric_columns"]})
        for c in prep["categorical_columns"]:
            # A missing category is stored as "", and scored as one (the model's unknown code).
            frame[c] = pd.Series([s[c] or None for s in samples], dtype=object)
        _, _, labels = self.encoder.encode(samples)
        return frame, labels


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


def _columns(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in manifest["schema"].items() if k != "fmt"}


def _label(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value
