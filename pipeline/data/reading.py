"""What training reads: one or more published dataset versions as StreamingDatasets, and a collate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data import local_path
from pipeline.data.tabular import read_manifest, read_preprocessing


@dataclass
class TrainingData:
    """The dataset versions a training run reads, with the encoding the model is built for."""

    dirs: list[Path]
    manifests: list[dict[str, Any]]
    preprocessing: dict[str, Any]
    cache_dir: Path

    @classmethod
    def open(cls, datasets: list[str], cache_dir: Path) -> "TrainingData":
        dirs = [local_path(uri) for uri in datasets]
        return cls(dirs=dirs, manifests=[read_manifest(d) for d in dirs],
                   preprocessing=read_preprocessing(dirs[0]), cache_dir=Path(cache_dir))

    @property
    def versions(self) -> list[str]:
        return [m["version"] for m in self.manifests]

    def rows(self, split: str) -> int:
        return sum(m["splits"][split] for m in self.manifests)

    def dataset(self, split: str, *, shuffle: bool, seed: int, batch_size: int):
        from streaming import StreamingDataset

        # The published version is the remote and each job gets its own local cache: two jobs reading
        # one version at once would otherwise collide on streaming's per-directory shared memory.
        return StreamingDataset(
            remote=str(self.dirs[0] / split), local=str(self.cache_dir / split), split=None, shuffle=shuffle,
            shuffle_seed=seed, batch_size=batch_size,
        )

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """Samples -> tensors ``num`` (float32), ``cat`` (int64), ``label`` (int64)."""
        import torch

        # np.stack copies, so the tensors own writable memory (streaming hands out read-only views).
        return {
            "num": torch.from_numpy(np.stack([np.asarray(s["num"], dtype=np.float32) for s in samples])),
            "cat": torch.from_numpy(np.stack([np.asarray(s["cat"], dtype=np.int64) for s in samples])),
            "label": torch.from_numpy(np.asarray([s["label"] for s in samples], dtype=np.int64)),
        }
