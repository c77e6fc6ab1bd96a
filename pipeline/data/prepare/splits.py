"""Deterministic train/val/test assignment: by a hash of a key (or the row position), by time, or by input file."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from pipeline.data.prepare import sources
from pipeline.data.prepare.plan import as_text, text_to_numbers
from pipeline.errors import ConfigError, DataError

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


@dataclass(frozen=True)
class TimeSplit:
    """Time-ordered splits (``data.split_by``): global cut-offs (``time``), or per-group cut-offs that
    hold out each group's newest rows (``last_per_group``). Rows at or after a cut-off time go to its
    split, so rows tied at a cut-off's time go together."""

    time_column: str
    group_column: str = ""
    val_from: float = float("inf")  # time: rows at or after it are val (test when also >= test_from)
    test_from: float = float("inf")
    groups: dict[str, tuple[float, float]] = field(default_factory=dict)  # group -> (val_from, test_from)

    def assign(self, table) -> np.ndarray:
        """Split code per row of a conformed batch (see ``assign``)."""
        times = np.asarray(table.column(self.time_column).to_numpy(zero_copy_only=False), dtype=np.float64)
        if self.group_column:
            keys = as_text(_array(table.column(self.group_column))).to_pylist()
            cuts = np.array([self.groups.get(g, _NO_HOLDOUT) for g in keys],
                            dtype=np.float64).reshape(len(times), 2)
            val_from, test_from = cuts[:, 0], cuts[:, 1]
        else:
            val_from, test_from = self.val_from, self.test_from
        codes = np.zeros(len(times), dtype=np.int8)
        codes[times >= val_from] = 1
        codes[times >= test_from] = 2
        return codes

    def describe(self) -> dict[str, Any]:
        if self.group_column:
            return {"by": "last_per_group", "time_column": self.time_column, "group_column": self.group_column,
                    "groups": len(self.groups),
                    "groups_held_out": sum(1 for v, t in self.groups.values() if t != _INF)}
        return {"by": "time", "time_column": self.time_column, "val_from": self.val_from, "test_from": self.test_from}


_INF = float("inf")
_NO_HOLDOUT = (_INF, _INF)


def _is_text(kind) -> bool:
    import pyarrow as pa

    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _array(column):
    """One Arrow array of a table's column (tables built from arrays hold one chunk; read ones, several)."""
    return column.combine_chunks() if hasattr(column, "combine_chunks") else column


@dataclass(frozen=True)
class FileSplit:
    """``data.split_by=files``: the rows of the input files that match ``test_files`` are the test split; the other
    files' rows go to train and val by the hash (``assign`` with no test fraction)."""

    test_files: tuple[str, ...]

    def is_test(self, relpath: str) -> bool:
        name = PurePosixPath(relpath).name
        return any(fnmatch.fnmatchcase(relpath, p) or fnmatch.fnmatchcase(name, p) for p in self.test_files)

    def test_rows(self, batch, files) -> np.ndarray:
        """Per row of ``batch`` (a ``plan.Batch`` read from ``files``, the unit's ``SourceFile``s): from a test file."""
        relpath = {f.uri: f.relpath for f in files}
        test = np.array([self.is_test(relpath[origin]) for origin in batch.origins], dtype=bool)
        return test if batch.first_row < 0 else np.full(batch.table.num_rows, bool(test[0]))

    def describe(self) -> dict[str, Any]:
        return {"by": "files", "test_files": list(self.test_files)}


def plan_file_split(cfg, inp) -> FileSplit | None:
    """The file split ``cfg`` asks for, checked against the input's files: some, not all, hold the test split."""
    if cfg.split_by != "files":
        return None
    if not cfg.test_files:
        raise ConfigError("data.split_by='files' needs data.test_files: patterns of the input files that hold the "
                          "test split (for example t10k-*)")
    split = FileSplit(tuple(cfg.test_files))
    names = [f.relpath for f in inp.files]
    test = [n for n in names if split.is_test(n)]
    if not test or len(test) == len(names):
        raise DataError(f"data.test_files {list(cfg.test_files)} match {'no' if not test else 'every'} input file of "
                        f"{inp.root} (the files: {names[:10]}{' ...' if len(names) > 10 else ''}); expected some "
                        f"files for test and the rest for train and val")
    return split


def check_time_split(cfg, schema, origin: str) -> bool:
    """Whether ``cfg`` splits by time; its columns checked against the input's Arrow ``schema``."""
    import pyarrow as pa

    if cfg.split_by in ("hash", "files"):
        return False
    if not cfg.time_column:
        raise ConfigError(f"data.split_by={cfg.split_by!r} needs data.time_column: the column of event times")
    if cfg.time_column not in schema.names:
        raise DataError(f"{origin}: data.time_column {cfg.time_column!r} is not a column; the columns are {schema.names}")
    kind = schema.field(cfg.time_column).type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or _is_text(kind)):
        raise DataError(f"{origin}: data.time_column {cfg.time_column!r} has type {kind}; expected numbers "
                        f"(event times such as epoch seconds)")
    if cfg.split_by == "last_per_group":
        if not cfg.group_column:
            raise ConfigError("data.split_by='last_per_group' needs data.group_column: the column whose values "
                              "(e.g. users) hold out their newest rows")
        if cfg.group_column not in schema.names:
            raise DataError(f"{origin}: data.group_column {cfg.group_column!r} is not a column; the columns are "
                            f"{schema.names}")
    return True


def plan_time_split(cfg, inp, units, origin: str) -> TimeSplit:
    """One pass over the input's time (and group) column: the cut-offs every worker applies."""
    import pyarrow as pa

    times, groups = [], []
    for unit in units:
        for batch in sources.read_unit(unit, inp.fmt, batch_rows=cfg.batch_rows,
                                       string_columns=[cfg.group_column] if cfg.group_column else []):
            column = _array(batch.table.column(cfg.time_column))
            if _is_text(column.type):  # CSV cells, or numbers stored as text
                values, wrong = text_to_numbers(column.to_numpy(zero_copy_only=False))
            else:
                values = column.cast(pa.float64()).to_numpy(zero_copy_only=False)
                wrong = np.isnan(values)
            bad = np.flatnonzero(wrong | np.isnan(values) | column.is_null().to_numpy(zero_copy_only=False))
            if len(bad):
                raise DataError(f"{batch.where(int(bad[0]))}, column {cfg.time_column!r}: time is "
                                f"{column[int(bad[0])].as_py()!r}; expected a number (data.split_by={cfg.split_by!r})")
            times.append(values)
            if cfg.group_column:
                groups.append(as_text(_array(batch.table.column(cfg.group_column))).to_numpy(zero_copy_only=False))
    times = np.concatenate(times) if times else np.zeros(0)
    if not cfg.group_column or cfg.split_by == "time":
        val_from = float(np.quantile(times, 1 - cfg.test_fraction - cfg.val_fraction)) if cfg.val_fraction else _INF
        test_from = float(np.quantile(times, 1 - cfg.test_fraction))
        return TimeSplit(cfg.time_column, val_from=min(val_from, test_from), test_from=test_from)
    return TimeSplit(cfg.time_column, cfg.group_column,
                     groups=_group_cutoffs(np.concatenate(groups), times, cfg.val_per_group, cfg.test_per_group))


def _group_cutoffs(groups: np.ndarray, times: np.ndarray, val_n: int, test_n: int) -> dict[str, tuple[float, float]]:
    """Per group, the times from which its rows are val and test: its newest ``test_n`` rows test, the
    ``val_n`` before val. A group with no more rows than that keeps them all in train."""
    order = np.lexsort((times, groups))  # by group, then time
    groups, times = groups[order], times[order]
    starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
    ends = np.r_[starts[1:], len(groups)]
    cutoffs = {}
    for start, end in zip(starts.tolist(), ends.tolist()):
        if end - start <= val_n + test_n:
            continue
        test_from = float(times[end - test_n])
        val_from = float(times[end - test_n - val_n]) if val_n else test_from
        cutoffs[str(groups[start])] = (val_from, test_from)
    return cutoffs
