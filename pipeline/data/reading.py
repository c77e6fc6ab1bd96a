"""What training and evaluation read: one or more dataset versions as the streams of one StreamingDataset.

Versions store raw values; their statistics merge into the preprocessing of the whole window
(vocabularies, mean/std, label classes), and ``collate`` encodes categories and labels with it. So a
window of daily versions reads as one dataset, whatever vocabulary each day had on its own.

``TrainingData.loader`` keeps streaming's partition, shuffle and mid-epoch resumption but reads each batch
as one piece from memory-mapped shards, decoded by column (``pipeline.data.loader``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pipeline.data import local_path
from pipeline.data.loader import BatchLoader, Shards, Source
from pipeline.data.prep import read_manifest, read_stats
from pipeline.errors import DataError


@dataclass
class TrainingData:
    """The dataset versions a training run reads, with the encoding the model is built for."""

    dirs: list[Path]
    manifests: list[dict[str, Any]]
    preprocessing: dict[str, Any]
    cache_dir: Path
    stats: Any = None  # the versions' merged statistics (pipeline.data.stats.Stats): counts per category

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
        return cls(dirs=dirs, manifests=manifests, preprocessing=stats.preprocessing(declared), cache_dir=Path(cache_dir),
                   stats=stats)

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

    def shards(self, split: str) -> Shards:
        """The split's shards over every version, in order. Each job reads through a local cache of its own
        (``cache_dir``), where a shard's file arrives checked against the version's index and manifest."""
        sources = [Source(d, m, split, self.cache_dir / m["version"] / split)
                   for d, m in zip(self.dirs, self.manifests) if m["splits"][split]]
        if not sources:
            raise DataError(f"split {split!r} has no rows in dataset version(s) {self.versions}")
        return Shards(sources)

    def loader(self, split: str, *, batch_size: int, shuffle: bool, seed: int, num_workers: int = 0,
               transform: Callable[[dict[str, Any]], Any]) -> BatchLoader:
        """A resumable loader over this rank's share of ``split``: ``state_dict`` and ``load_state_dict`` give a
        mid-epoch position. Each batch is ``transform(columns)``, ``columns`` being the batch's decoded columns
        (see ``pipeline.data.shards.decode_columns``); ``transform`` must be picklable when ``num_workers > 0``.

        Batches hold the samples, in the order, of a ``StreamingDataLoader`` over a ``StreamingDataset`` of the
        same streams, but a batch is read as one piece from memory-mapped shards and decoded by column with
        numpy: keep ``num_workers=0`` unless images take long to decode and cores are spare.
        (``pipeline.data.ray_reader.ray_loader`` is the same through Ray Data.)"""
        import torch

        # Loaders draw a base seed at every iter(); from their own generator, so that the global stream
        # (dropout, augmentation) is the same after a mid-epoch resume as in an uninterrupted run.
        return BatchLoader(self.shards(split), batch_size=batch_size, shuffle=shuffle, seed=seed,
                           num_workers=num_workers, transform=transform, generator=torch.Generator().manual_seed(seed))

    def read_split(self, split: str) -> dict[str, Any]:
        """Every row of ``split`` (all versions, in order) as decoded columns (see ``decode_columns``)."""
        return self.shards(split).read_all(self.schema["columns"])

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
        columns = self.read_split(split)
        _, _, labels = self.encoder.encode_columns(columns)
        return feature_frame(columns, self.preprocessing), labels


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


def _columns(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in manifest["schema"].items() if k != "fmt"}


def _label(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value
