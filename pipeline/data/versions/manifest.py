"""A published version's files read back: its manifest (schema, splits, rows, every file's digest), the
preprocessing and the mergeable statistics of its training split."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.data.versions.stats import Stats

MANIFEST = "manifest.json"
PREPROCESSING = "preprocessing.json"
STATS = "stats.json"


def read_manifest(dataset_dir: Path) -> dict[str, Any]:
    return json.loads((Path(dataset_dir) / MANIFEST).read_text())


def read_preprocessing(dataset_dir: Path) -> dict[str, Any]:
    return json.loads((Path(dataset_dir) / PREPROCESSING).read_text())


def read_stats(dataset_dir: Path) -> Stats:
    return Stats.from_dict(json.loads((Path(dataset_dir) / STATS).read_text()))
