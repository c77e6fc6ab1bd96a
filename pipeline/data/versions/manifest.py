"""A published version's files read back: its manifest (schema, splits, rows, every file's digest), the
preprocessing and the mergeable statistics of its training split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline import storage
from pipeline.data.versions.stats import Stats

MANIFEST = "manifest.json"
PREPROCESSING = "preprocessing.json"
STATS = "stats.json"


def read_manifest(dataset_dir: Path | str) -> dict[str, Any]:
    """The manifest of the version at ``dataset_dir`` (a folder or an object-store URI)."""
    return storage.read_json(storage.join(dataset_dir, MANIFEST))


def read_preprocessing(dataset_dir: Path | str) -> dict[str, Any]:
    return storage.read_json(storage.join(dataset_dir, PREPROCESSING))


def read_stats(dataset_dir: Path | str) -> Stats:
    return Stats.from_dict(storage.read_json(storage.join(dataset_dir, STATS)))
