"""Parquet -> MDS for tabular classification: schema checks, vocabularies, splits, a manifest.

Two streaming passes over Arrow record batches (never the whole table in memory): the first
validates every row and gathers the training split's vocabularies and feature statistics, the
second encodes and writes one MDS dataset per split. Output goes to a temporary folder that is
renamed into place only when complete, so readers never see half a dataset.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.config import DataConfig
from pipeline.data import splits
from pipeline.errors import DataError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PREPROCESSING = "preprocessing.json"
UNKNOWN = "<unk>"  # code 0 of every vocabulary: unseen or missing categories


@dataclass(kw_only=True)
class Schema:
    numeric_columns: list[str]
    categorical_columns: list[str]
    label_column: str
    label_kind: str  # "int" or "str"
    key_column: str


def prepare(cfg: DataConfig, *, name: str, out_root: Path) -> dict[str, Any]:
    """Publish the dataset version for ``cfg`` under ``out_root/name/VERSION`` and return its manifest.

    Idempotent: when that version is already published, its manifest is returned with
    ``skipped: true`` and nothing is read beyond the inputs' bytes for the digest.
    """
    started = time.perf_counter()
    files = input_files(cfg.input_path)
    schema = infer_schema(files, cfg)
    sources = [_describe_source(f) for f in files]
    version = _version(sources, cfg)
    final = out_root / name / version
    if (final / MANIFEST).exists():
        manifest = read_manifest(final)
        log.info("dataset %s version %s already published at %s: skipping", name, version, final)
        return {**manifest, "skipped": True}

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{version}-{uuid.uuid4().hex[:8]}"
    try:
        prep = _scan(files, schema, cfg)
        rows = _write(files, schema, cfg, prep, tmp)
        if rows["train"] == 0 or rows["test"] == 0:
            raise DataError(
                f"{cfg.input_path}: splits came out with rows {rows}; the train and test splits "
                f"need at least one row each (more input rows or other split fractions)"
            )
        manifest = {
            "format_version": FORMAT_VERSION,
            "name": name,
            "version": version,
            "uri": final.as_uri(),
            "sources": sources,
            "config": asdict(cfg),
            "schema": asdict(schema),
            "label_classes": prep["label_classes"],
            "splits": rows,
            "sample_rows": prep["sample_rows"],
            "prep_wall_s": round(time.perf_counter() - started, 3),
        }
        _write_json(tmp / PREPROCESSING, {
            "numeric_columns": schema.numeric_columns, "categorical_columns": schema.categorical_columns,
            **{key: prep[key] for key in ("vocab", "mean", "std", "label_classes")},
        })
        _write_json(tmp / MANIFEST, manifest)  # written last: its presence marks a complete version
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).exists():
                raise
            log.info("version %s was published concurrently; keeping that copy", version)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("published dataset %s version %s: %s rows per split, %.1f s", name, version, rows,
             manifest["prep_wall_s"])
    return {**manifest, "skipped": False}


def read_manifest(dataset_dir: Path) -> dict[str, Any]:
    return json.loads((Path(dataset_dir) / MANIFEST).read_text())


def read_preprocessing(dataset_dir: Path) -> dict[str, Any]:
    return json.loads((Path(dataset_dir) / PREPROCESSING).read_text())


def input_files(input_path: str) -> list[Path]:
    """The Parquet files behind ``input_path`` (a file, or a folder searched recursively), sorted."""
    if not input_path:
        raise DataError("data.input_path is empty: expected a Parquet file or a folder of Parquet files")
    path = Path(input_path)
    if not path.exists():
        raise DataError(f"data.input_path {input_path!r} does not exist: expected a Parquet file or folder")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*.parquet") if p.is_file() and not p.name.startswith((".", "_")))
    if not files:
        raise DataError(f"data.input_path {input_path!r} is a folder with no *.parquet files in it")
    return files


def infer_schema(files: list[Path], cfg: DataConfig) -> Schema:
    """Decide each column's role from the Arrow schema; refuse what the model cannot take."""
    arrow_schema = _read_schema(files[0])
    for other in files[1:]:
        other_schema = _read_schema(other)
        if not other_schema.equals(arrow_schema):
            raise DataError(
                f"{other}: schema {other_schema.to_string(show_schema_metadata=False)!r} differs from "
                f"{files[0]}'s {arrow_schema.to_string(show_schema_metadata=False)!r}; all input files "
                f"must share one schema"
            )
    names = arrow_schema.names
    for role, column in (("label_column", cfg.label_column), ("key_column", cfg.key_column)):
        if column and column not in names:
            raise DataError(f"{files[0]}: data.{role} {column!r} is not a column; the columns are {names}")
    missing = [c for c in cfg.categorical_columns if c not in names]
    if missing:
        raise DataError(f"{files[0]}: data.categorical_columns {missing} are not columns; the columns are {names}")

    label_type = arrow_schema.field(cfg.label_column).type
    if pa.types.is_integer(label_type) or pa.types.is_boolean(label_type):
        label_kind = "int"
    elif pa.types.is_string(label_type) or pa.types.is_large_string(label_type):
        label_kind = "str"
    else:
        raise DataError(
            f"{files[0]}: label column {cfg.label_column!r} has type {label_type}; expected integer or "
            f"string class labels"
        )

    numeric, categorical = [], []
    for field in arrow_schema:
        if field.name in (cfg.label_column, cfg.key_column):
            continue
        kind = field.type
        if field.name in cfg.categorical_columns or _is_text(kind):
            categorical.append(field.name)
        elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
            numeric.append(field.name)
        else:
            raise DataError(
                f"{files[0]}: feature column {field.name!r} has type {kind}; features must be numeric "
                f"(integer, float, bool) or string (categorical). Drop or convert the column."
            )
    if not numeric and not categorical:
        raise DataError(f"{files[0]}: no feature columns besides the label {cfg.label_column!r}")
    return Schema(
        numeric_columns=numeric, categorical_columns=categorical, label_column=cfg.label_column,
        label_kind=label_kind, key_column=cfg.key_column,
    )


def _is_text(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _read_schema(path: Path) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from exc


def _describe_source(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return {"path": str(path), "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _version(sources: list[dict[str, Any]], cfg: DataConfig) -> str:
    """Content digest of the inputs and of every config field that changes the output."""
    relevant = {k: v for k, v in asdict(cfg).items() if k not in ("input_path", "batch_rows")}
    blob = json.dumps(
        {"format": FORMAT_VERSION, "config": relevant, "inputs": [s["sha256"] for s in sources]},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class _Batch:
    path: Path
    first_row: int  # row number of the batch's first row within its file
    global_first_row: int  # position over all files, for position-keyed splits
    table: pa.RecordBatch


def _batches(files: list[Path], schema: Schema, cfg: DataConfig) -> Iterator[_Batch]:
    columns = schema.numeric_columns + schema.categorical_columns + [schema.label_column]
    if schema.key_column:
        columns.append(schema.key_column)
    offset = 0
    for path in files:
        in_file = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=cfg.batch_rows, columns=columns):
            yield _Batch(path, in_file, offset, batch)
            in_file += batch.num_rows
            offset += batch.num_rows


def _split_codes(batch: _Batch, schema: Schema, cfg: DataConfig) -> np.ndarray:
    if schema.key_column:
        keys = splits.key_hashes(batch.table.column(schema.key_column).to_pylist())
    else:
        keys = np.arange(batch.global_first_row, batch.global_first_row + batch.table.num_rows, dtype=np.uint64)
    return splits.assign(keys, seed=cfg.split_seed, val_fraction=cfg.val_fraction, test_fraction=cfg.test_fraction)


def _numeric_matrix(batch: _Batch, schema: Schema) -> np.ndarray:
    """float64 matrix of the numeric features; a null or non-finite value is a DataError naming it."""
    out = np.empty((batch.table.num_rows, len(schema.numeric_columns)), dtype=np.float64)
    for j, name in enumerate(schema.numeric_columns):
        column = batch.table.column(name)
        if column.null_count:
            row = int(pc.index(pc.is_null(column), True).as_py())
            raise DataError(
                f"{batch.path}: row {batch.first_row + row}, column {name!r}: value is null; "
                f"expected a finite number"
            )
        values = column.cast(pa.float64()).to_numpy(zero_copy_only=False)
        bad = ~np.isfinite(values)
        if bad.any():
            row = int(np.argmax(bad))
            raise DataError(
                f"{batch.path}: row {batch.first_row + row}, column {name!r}: value {float(values[row])!r}; "
                f"expected a finite number"
            )
        out[:, j] = values
    return out


def _labels(batch: _Batch, schema: Schema) -> list:
    column = batch.table.column(schema.label_column)
    if column.null_count:
        row = int(pc.index(pc.is_null(column), True).as_py())
        raise DataError(
            f"{batch.path}: row {batch.first_row + row}, column {schema.label_column!r}: label is null; "
            f"expected a class label"
        )
    if schema.label_kind == "int":
        return column.cast(pa.int64()).to_pylist()
    return column.to_pylist()


def _categories(batch: _Batch, name: str) -> list[str | None]:
    column = batch.table.column(name)
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    return column.cast(pa.string()).to_pylist()


def _scan(files: list[Path], schema: Schema, cfg: DataConfig) -> dict[str, Any]:
    """Pass 1: validate every row; vocabularies and statistics from the training split only."""
    counters = {name: Counter() for name in schema.categorical_columns}
    n = 0
    total = np.zeros(len(schema.numeric_columns))
    total_sq = np.zeros(len(schema.numeric_columns))
    classes: set = set()
    sample_rows: list[dict[str, Any]] = []
    rows_seen = 0
    for batch in _batches(files, schema, cfg):
        is_train = _split_codes(batch, schema, cfg) == 0
        numeric = _numeric_matrix(batch, schema)
        total += numeric[is_train].sum(axis=0)
        total_sq += (numeric[is_train] ** 2).sum(axis=0)
        n += int(is_train.sum())
        classes.update(_labels(batch, schema))
        for name in schema.categorical_columns:
            values = _categories(batch, name)
            counters[name].update(v for v, keep in zip(values, is_train) if keep and v is not None)
        if len(sample_rows) < 5:
            features = schema.numeric_columns + schema.categorical_columns
            sample_rows += batch.table.select(features).slice(0, 5 - len(sample_rows)).to_pylist()
        rows_seen += batch.table.num_rows
        log.info("scanned %d rows", rows_seen)
    if rows_seen == 0:
        raise DataError(f"{cfg.input_path}: the input has no rows")
    if len(classes) < 2:
        raise DataError(
            f"{cfg.input_path}: label column {schema.label_column!r} has {len(classes)} distinct value(s) "
            f"{sorted(classes)}; expected at least 2 classes"
        )
    mean = total / max(n, 1)
    std = np.sqrt(np.maximum(total_sq / max(n, 1) - mean**2, 0.0))
    return {
        "vocab": {name: [UNKNOWN] + sorted(counter) for name, counter in counters.items()},
        "mean": mean.tolist(),
        "std": std.tolist(),
        "label_classes": sorted(classes),
        "sample_rows": sample_rows,
    }


def mds_columns(schema: Schema) -> dict[str, str]:
    return {
        "num": f"ndarray:float32:{len(schema.numeric_columns)}",
        "cat": f"ndarray:int64:{len(schema.categorical_columns)}",
        "label": "int",
    }


def _write(files: list[Path], schema: Schema, cfg: DataConfig, prep: dict[str, Any], out: Path) -> dict[str, int]:
    """Pass 2: encode every row and write one MDS dataset per split."""
    from streaming import MDSWriter

    code_of = {name: {value: i for i, value in enumerate(vocab)} for name, vocab in prep["vocab"].items()}
    label_index = {label: i for i, label in enumerate(prep["label_classes"])}
    compression = None if cfg.compression == "none" else cfg.compression
    writers = {
        split: MDSWriter(out=str(out / split), columns=mds_columns(schema), compression=compression,
                         hashes=["sha1", "xxh64"], size_limit=cfg.shard_size_limit_bytes)
        for split in splits.SPLITS
    }
    rows = dict.fromkeys(splits.SPLITS, 0)
    try:
        for batch in _batches(files, schema, cfg):
            codes = _split_codes(batch, schema, cfg)
            numeric = _numeric_matrix(batch, schema).astype(np.float32)
            categorical = np.zeros((batch.table.num_rows, len(schema.categorical_columns)), dtype=np.int64)
            for j, name in enumerate(schema.categorical_columns):
                lookup = code_of[name]
                categorical[:, j] = [lookup.get(v, 0) for v in _categories(batch, name)]
            labels = [label_index[v] for v in _labels(batch, schema)]
            for i, code in enumerate(codes):
                split = splits.SPLITS[code]
                writers[split].write({"num": numeric[i], "cat": categorical[i], "label": labels[i]})
                rows[split] += 1
            log.info("wrote %d rows (%s)", sum(rows.values()), rows)
    finally:
        for writer in writers.values():
            writer.finish()
    return rows


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str))


def load_split(dataset_dir: Path, split: str, cache_dir: Path):
    """A split as raw feature rows (categories decoded back to text) and label indices.

    Read through ``StreamingDataset`` like training does, so evaluation sees exactly what the
    published shards hold.
    """
    import pandas as pd
    from streaming import StreamingDataset

    prep = read_preprocessing(dataset_dir)
    dataset = StreamingDataset(remote=str(Path(dataset_dir) / split), local=str(cache_dir / split), shuffle=False)
    samples = [dataset[i] for i in range(dataset.num_samples)]
    num = np.stack([s["num"] for s in samples]) if samples else np.zeros((0, len(prep["numeric_columns"])))
    cat = np.stack([s["cat"] for s in samples]) if samples else np.zeros((0, len(prep["categorical_columns"])))
    frame = pd.DataFrame(num.astype(np.float64), columns=prep["numeric_columns"])
    for j, column in enumerate(prep["categorical_columns"]):
        frame[column] = np.asarray(prep["vocab"][column], dtype=object)[cat[:, j]]
    labels = np.asarray([s["label"] for s in samples], dtype=np.int64)
    return frame, labels
