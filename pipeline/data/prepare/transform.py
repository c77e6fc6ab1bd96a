"""Row transforms: a recipe's step of the preparation that turns validated input rows into the rows
stored (tokenization for language models), run by every conversion worker and part of the version.

``data.transform`` names a factory, ``module:ATTR``, called with the data config; it returns an object
with:

- ``input_columns``: the input columns it reads (they need no role or encoding of their own);
- ``encodings``: the MDS encoding of every column it returns;
- ``files``: ``{name: path}`` of files or folders it depends on (a tokenizer): their bytes are part of
  the version's digest and they are copied into the version under ``transform/NAME``;
- ``check_columns(names, origin)``: raise a DataError when the input lacks what it reads;
- ``__call__(table, split) -> (table, counts)``: the rows to store and counts to add up in the manifest
  (``counts`` of every unit and split are summed); a bad row raises ``RowError``. It runs on each
  split's rows of a batch separately, so rows it packs together never come from two splits.

Its settings are the data config's own fields (a recipe's subclass of ``DataConfig``), which are in
the digest already. The object is pickled to the workers: load heavy state lazily.
"""

from __future__ import annotations

import hashlib
import importlib
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import ConfigError, DataError

FOLDER = "transform"  # in a dataset version: the transform's files


def load(cfg) -> Any | None:
    """The row transform that ``cfg.transform`` names, or None when it names none."""
    ref = getattr(cfg, "transform", "")
    if not ref:
        return None
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"data.transform={ref!r}: expected module:ATTR, e.g. pipeline.recipes.llm_sft.tokenize:make")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"data.transform={ref!r}: cannot import it ({exc})") from None
    return factory(cfg)


def files_digest(transform) -> list[list[str]]:
    """``[name, relative path, sha256]`` of every file the transform depends on, in a stable order."""
    out = []
    for name, path in sorted(transform.files.items()):
        path = Path(path)
        if not path.exists():
            raise DataError(f"data.transform: file {name!r} at {path} does not exist")
        members = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for member in members:
            rel = member.relative_to(path).as_posix() if path.is_dir() else path.name
            out.append([name, rel, hashlib.sha256(member.read_bytes()).hexdigest()])
    return out


def copy_files(transform, version_dir: Path) -> None:
    """The transform's files into the version (``transform/NAME``), so its readers need no other copy."""
    for name, path in transform.files.items():
        target = Path(version_dir) / FOLDER / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if Path(path).is_dir():
            shutil.copytree(path, target)
        else:
            shutil.copy2(path, target)


class RowError(Exception):
    """A transform's bad input row: its index in the table the transform got, the column and what is wrong."""

    def __init__(self, row: int, column: str, problem: str):
        super().__init__(f"row {row}, column {column!r}: {problem}")
        self.row, self.column, self.problem = row, column, problem


def apply_by_split(transform, table, codes: np.ndarray, counts: Counter, where, rows: np.ndarray):
    """``transform(rows, split)`` on each split's rows of ``table`` (split codes ``codes``); the rows out,
    grouped by split in split order, and their codes. ``rows`` are the table's row numbers in the batch
    and ``where(row)`` names one: a ``RowError`` becomes a DataError naming file, row and column."""
    import pyarrow as pa

    from pipeline.data.prepare.splits import SPLITS

    tables, out_codes = [], []
    for code in np.unique(codes):
        mask = codes == code
        try:
            out, found = transform(table.filter(pa.array(mask)), SPLITS[int(code)])
        except RowError as exc:
            raise DataError(f"{where(int(rows[np.flatnonzero(mask)[exc.row]]))}, column {exc.column!r}: "
                            f"{exc.problem}") from None
        counts.update(found)
        tables.append(out)
        out_codes.append(np.full(out.num_rows, code, dtype=codes.dtype))
    if not tables:
        empty, _ = transform(table.slice(0, 0), SPLITS[0])
        return empty, codes[:0]
    return pa.concat_tables(tables), np.concatenate(out_codes)
