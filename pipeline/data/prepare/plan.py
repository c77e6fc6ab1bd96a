"""The types and small helpers the preparation modules share: input files, work units, record batches, the plan.

This module imports no other module of the preparation (``sources``, ``splits``, ``validate``, ``schema``),
so each of them can import it and their imports point one way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pipeline.data.versions.stats import MISSING


@dataclass(frozen=True)
class SourceFile:
    uri: str  # what fsspec opens
    relpath: str  # path below the input root: the file's identity in keys, errors and the manifest
    size: int
    partner: str = ""  # IDX: the labels file beside an images file
    staged: tuple[str, ...] = ()  # IDX: local plain copies of (images, labels) that workers read


@dataclass(frozen=True)
class Unit:
    """One worker's share: a range of one file's row groups/rows, or a run of image files."""

    index: int
    files: tuple[SourceFile, ...]
    start: int = 0
    stop: int = -1  # exclusive; -1 is "to the end"
    size_bytes: int = 0  # uncompressed input bytes, as far as known before reading: what the work is sized by


@dataclass
class Batch:
    """A record batch, where each of its rows came from, and the rows' split keys."""

    table: object  # pyarrow.RecordBatch or Table
    origins: list[str]  # per row, or one entry for the whole batch
    first_row: int  # row number within the origin file of the batch's first row (-1: per-row origins)
    keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))

    def where(self, i: int) -> str:
        if self.first_row < 0:
            return self.origins[i]
        return f"{self.origins[0]}: row {self.first_row + i}"


@dataclass
class Input:
    fmt: str
    root: str
    files: list[SourceFile]


@dataclass(kw_only=True)
class Plan:
    """What every worker needs: the columns' roles and encodings, and the preparation settings."""

    fmt: str
    columns: list[str]
    label_column: str
    label_kind: str  # "int" or "str"
    key_column: str
    numeric_columns: list[str]
    categorical_columns: list[str]
    image_columns: list[str]
    array_columns: list[str]
    encodings: dict[str, str]  # MDS column -> encoding; MDS columns are the input's columns
    declared_classes: list[str]
    text_columns: list[str] = field(default_factory=list)  # CSV: read as text, converted here per row
    on_bad_rows: str = "fail"
    val_fraction: float = 0.1
    test_fraction: float = 0.1
    split_seed: int = 0
    compression: str | None = "zstd"
    size_limit: int = 1 << 26
    batch_rows: int = 65_536
    parent_pid: int = 0  # workers stop when the process that started them is gone (killed)
    # A recipe's row transform (pipeline.data.prepare.transform): ``columns`` are then its input and
    # ``encodings`` are of the columns it returns.
    transform: Any = None
    time_split: Any = None  # a splits.TimeSplit when data.split_by is time or last_per_group
    file_split: Any = None  # a splits.FileSplit when data.split_by is files

    def schema(self) -> dict[str, Any]:
        schema = {k: v for k, v in asdict(self).items() if k in (
            "fmt", "columns", "label_column", "label_kind", "key_column", "numeric_columns",
            "categorical_columns", "image_columns", "array_columns", "encodings")}
        if self.transform is not None:
            schema |= {"input_columns": self.columns, "columns": sorted(self.encodings)}
        return schema


# --- split keys -----------------------------------------------------------------------------------

def key_hashes(values: list) -> np.ndarray:
    """Stable uint64 hashes of arbitrary key values (their text form), independent of the process."""
    import pandas as pd

    return pd.util.hash_array(np.asarray([str(v) for v in values], dtype=object)).astype(np.uint64)


def position_keys(relpath: str, first_row: int, rows: int) -> np.ndarray:
    """Split keys of rows keyed by position: the file's identity plus the row's number within it,
    so rows appended to a file, or files added beside it, leave every existing row where it was."""
    import hashlib

    base = np.uint64(int.from_bytes(hashlib.blake2b(relpath.encode(), digest_size=8).digest(), "little"))
    with np.errstate(over="ignore"):
        return base + np.arange(first_row, first_row + rows, dtype=np.uint64)


# --- values read as text --------------------------------------------------------------------------

def as_text(column):
    """An Arrow column as strings (dictionaries decoded), a missing value as ``MISSING``."""
    import pyarrow as pa

    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    return column.cast(pa.string()).fill_null(MISSING)


def text_to_numbers(text: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Text values as float64, and where a value is not a number (NaN there). ``nan`` is a number
    (a non-finite one), and ``true``/``false`` are 1 and 0 (CSV booleans)."""
    import pandas as pd

    values = pd.to_numeric(pd.Series(text), errors="coerce").to_numpy(np.float64, copy=True)
    lowered = np.char.lower(text.astype(str))
    values[lowered == "true"], values[lowered == "false"] = 1.0, 0.0
    return values, np.isnan(values) & (lowered != "nan")
