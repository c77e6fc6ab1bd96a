"""Synthetic inputs for the demo, the tests and the benchmarks: a tabular classification set (numeric
and categorical features, three classes, a label that depends on interactions no linear model can
fit), written whole or as daily hive partitions, and MNIST-style IDX files."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

REGIONS = ["north", "south", "east", "west", "central", "islands"]
DEVICES = ["phone", "tablet", "desktop", "tv"]
PLANS = ["free", "basic", "pro"]


def make_table(rows: int, *, seed: int = 0):
    """The demo rows as an Arrow table (6 numeric and 3 categorical features, ``label``)."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6))
    x[:, 3] = x[:, 3] * 250.0 + 1000.0  # a wide-ranged feature: the model must standardize
    region = rng.integers(0, len(REGIONS), rows)
    device = rng.integers(0, len(DEVICES), rows)
    plan = rng.integers(0, len(PLANS), rows)
    region_effect = np.array([0.8, -0.6, 0.3, -0.2, 0.0, 1.0])
    device_effect = np.array([-0.5, 0.2, 0.7, -0.4])
    plan_effect = np.array([-0.7, 0.1, 0.9])
    scores = np.stack(
        [
            1.6 * x[:, 0] * x[:, 1] + np.sin(2.0 * x[:, 2]) + region_effect[region],
            x[:, 2] ** 2 - 1.0 + 0.8 * (x[:, 3] - 1000.0) / 250.0 + device_effect[device],
            -x[:, 0] + 0.8 * np.abs(x[:, 4]) + plan_effect[plan] + 0.3 * x[:, 5],
        ],
        axis=1,
    )
    noise = rng.gumbel(size=scores.shape) * 0.6
    label = np.argmax(scores + noise, axis=1)
    columns = {f"x{i}": x[:, i] for i in range(6)}
    columns |= {
        "region": np.array(REGIONS)[region],
        "device": np.array(DEVICES)[device],
        "plan": np.array(PLANS)[plan],
        "label": label.astype(np.int64),
    }
    return pa.table(columns)


def write_parquet(path: Path, rows: int, *, seed: int = 0, row_group_rows: int = 10_000) -> Path:
    """Write the demo rows to ``path`` atomically (temporary name, then rename)."""
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(make_table(rows, seed=seed), tmp, row_group_size=row_group_rows)
    os.replace(tmp, path)
    return path


def write_partitions(root: Path, days: list[str], rows_per_day: int, *, seed: int = 0) -> list[Path]:
    """One Parquet file per day under ``root/dt=DAY/`` (hive partitions), each day its own draw."""
    return [
        write_parquet(Path(root) / f"dt={day}" / "part-0.parquet", rows_per_day, seed=seed + i)
        for i, day in enumerate(days)
    ]


def write_idx(directory: Path, prefix: str, images: np.ndarray, labels: np.ndarray, *, gz: bool = True) -> Path:
    """MNIST-style files: PREFIX-images-idx3-ubyte[.gz] and PREFIX-labels-idx1-ubyte[.gz]."""
    directory.mkdir(parents=True, exist_ok=True)
    n, rows, cols = images.shape
    image_bytes = bytes([0, 0, 8, 3]) + b"".join(d.to_bytes(4, "big") for d in (n, rows, cols)) + images.astype(np.uint8).tobytes()
    label_bytes = bytes([0, 0, 8, 1]) + len(labels).to_bytes(4, "big") + labels.astype(np.uint8).tobytes()
    suffix = ".gz" if gz else ""
    for name, data in ((f"{prefix}-images-idx3-ubyte{suffix}", image_bytes), (f"{prefix}-labels-idx1-ubyte{suffix}", label_bytes)):
        (directory / name).write_bytes(gzip.compress(data) if gz else data)
    return directory


def write_digits_idx(directory: Path, prefix: str = "digits") -> Path:
    """scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes) as MNIST-style IDX files.

    Real data that ships with a package: nothing is downloaded. Pixel values 0..16 are scaled to 0..255."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.clip(np.rint(digits.images * (255 / 16)), 0, 255).astype(np.uint8)
    return write_idx(Path(directory), prefix, images, digits.target.astype(np.uint8))
