"""Deterministic train/val/test assignment by a hash of a key (or the row position)."""

from __future__ import annotations

import numpy as np

SPLITS = ("train", "val", "test")

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash of each element."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def assign(keys: np.ndarray, *, seed: int, val_fraction: float, test_fraction: float) -> np.ndarray:
    """Split code per row: 0 train, 1 val, 2 test. ``keys`` are uint64 (row positions or key hashes).

    A row's split depends only on its key and the seed, so re-runs and appended rows keep every
    existing row where it was.
    """
    with np.errstate(over="ignore"):
        h = _mix64(keys.astype(np.uint64) + np.uint64(seed) * _GOLDEN)
    u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    codes = np.zeros(len(keys), dtype=np.int8)
    codes[u < test_fraction + val_fraction] = 1
    codes[u < test_fraction] = 2
    return codes


def key_hashes(values: list) -> np.ndarray:
    """Stable uint64 hashes of arbitrary key values (their text form), independent of the process."""
    import pandas as pd

    return pd.util.hash_array(np.asarray([str(v) for v in values], dtype=object)).astype(np.uint64)
