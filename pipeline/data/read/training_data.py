"""What training and evaluation read: one or more dataset versions as the streams of one StreamingDataset.

Versions store raw values; their statistics merge into the preprocessing of the whole window
(vocabularies, mean/std, label classes), and ``collate`` encodes categories and labels with it. So a
window of daily versions reads as one dataset, whatever vocabulary each day had on its own.

``TrainingData.loader`` keeps streaming's partition, shuffle and mid-epoch resumption but reads each batch
as one piece from memory-mapped shards, decoded by column (``pipeline.data.read.loader``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from pipeline.data import version_location
from pipeline.data.read.loader import BatchLoader, Shards, Source
from pipeline.data.read.tabular import Encoder, feature_frame
from pipeline.data.versions.manifest import read_manifest, read_stats
from pipeline.errors import DataError


@dataclass
class TrainingData:
    """The dataset versions a training run reads, with the encoding the model is built for."""

    dirs: list[Path | str]  # each version's folder, or its object-store URI
    manifests: list[dict[str, Any]]
    preprocessing: dict[str, Any]
    cache_dir: Path
    stats: Any = None  # the versions' merged statistics (pipeline.data.versions.stats.Stats): counts per category

    @classmethod
    def open(cls, datasets: list[str], cache_dir: Path) -> "TrainingData":
        if isinstance(datasets, (str, Path)):
            datasets = [str(datasets)]
        if not datasets:
            raise DataError("no dataset versions to read: expected at least one dataset URI")
        dirs = [version_location(str(uri)) for uri in datasets]
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
        (see ``pipeline.data.read.shards.decode_columns``); ``transform`` must be picklable when ``num_workers > 0``.

        Batches hold the samples, in the order, of a ``StreamingDataLoader`` over a ``StreamingDataset`` of the
        same streams, but a batch is read as one piece from memory-mapped shards and decoded by column with
        numpy: keep ``num_workers=0`` unless images take long to decode and cores are spare.
        (``pipeline.data.read.ray_data.ray_loader`` is the same through Ray Data.)"""
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


def _columns(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in manifest["schema"].items() if k != "fmt"}
