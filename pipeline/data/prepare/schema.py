"""The plan of a preparation: each input column's role (label, key, numeric, categorical, image, array)
and MDS encoding, inferred from the first rows and the config, checked before any row is converted."""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np

from pipeline.config import DataConfig
from pipeline.data.prepare import mds_writer, sources, splits
from pipeline.data.prepare.plan import Batch, Input, Plan, Unit, text_to_numbers
from pipeline.errors import ConfigError, DataError

# A text feature column becomes categorical only when it looks like categories. Two kinds of text
# column do not, and each would silently become a categorical feature with a category per value
# (useless to the model, and every unseen value maps to <unk>): numbers stored as text, which one
# stray token such as "n/a" makes of a CSV column or a Parquet string column; and identifiers or
# free text. Both fail the preparation until the column is declared numeric or categorical.
NUMERIC_TEXT_FRACTION = 0.9  # at least this share of the sampled values read as numbers: numbers as text
DISTINCT_FRACTION = 0.9  # at least this many distinct values per sampled row: not categories
# Below this many sampled values, a column of a few categories can be all distinct by chance.
DISTINCT_MIN_VALUES = 50
# The first rows of the input that the two checks above read: enough that a few hundred real
# categories repeat (about 4 draws each), cheap to read; only read when a text feature column needs judging.
TEXT_SAMPLE_ROWS = 4096
_SCHEMA_BATCH_ROWS = 256


def infer_plan(inp: Input, units: list[Unit], cfg: DataConfig, transform: Any = None) -> Plan:
    """Each column's role and MDS encoding, from the first rows' Arrow schema and the config; with a
    row ``transform``, the encodings of what it returns."""
    import pyarrow as pa

    first, rest = _first_batch(inp, units)
    if first is None:
        raise DataError(f"{cfg.input_path}: the input has no rows")
    schema, origin = first.table.schema, first.origins[0]
    names = list(schema.names)
    columns = list(cfg.columns) or names
    check_columns(names, columns, origin)
    for role, column in (("label_column", cfg.label_column), ("key_column", cfg.key_column)):
        if column and column not in names:
            raise DataError(f"{origin}: data.{role} {column!r} is not a column; the columns are {names}")
    if transform is not None:
        transform.check_columns(names, origin)
        rest.close()
        return Plan(
            fmt=inp.fmt, columns=columns, label_column=cfg.label_column, label_kind="str", key_column=cfg.key_column,
            numeric_columns=[], categorical_columns=[], image_columns=[], array_columns=[],
            encodings=dict(transform.encodings), declared_classes=[], on_bad_rows=cfg.on_bad_rows,
            val_fraction=cfg.val_fraction, test_fraction=cfg.test_fraction, split_seed=cfg.split_seed,
            compression=None if cfg.compression == "none" else cfg.compression, size_limit=cfg.shard_size_limit_bytes,
            batch_rows=cfg.batch_rows, parent_pid=os.getpid(), transform=transform,
        )
    missing = [c for c in cfg.categorical_columns if c not in names]
    if missing:
        raise DataError(f"{origin}: data.categorical_columns {missing} are not columns; the columns are {names}")
    overrides = mds_writer.parse_overrides(cfg.column_encodings)

    label_type = schema.field(cfg.label_column).type if cfg.label_column else None
    if label_type is None:
        label_kind = "none"  # data without labels: interactions, text
    elif pa.types.is_integer(label_type) or pa.types.is_boolean(label_type):
        label_kind = "int"
    elif pa.types.is_string(label_type) or pa.types.is_large_string(label_type) or pa.types.is_dictionary(label_type):
        label_kind = "str"
    else:
        raise DataError(f"{origin}: label column {cfg.label_column!r} has type {label_type}; expected integer or "
                        f"string class labels")

    time_split = splits.check_time_split(cfg, schema, origin)
    numeric, categorical, images, arrays, encodings = [], [], [], [], {}
    undeclared_text = []
    for name in columns:
        kind = schema.field(name).type
        if name == cfg.label_column:
            encodings[name] = "int64" if label_kind == "int" else "str"
            continue
        if name == cfg.key_column:
            encodings[name] = "str"
            continue
        if name in cfg.categorical_columns:
            categorical.append(name)
            encodings[name] = "str"
            continue
        if is_text(kind):
            if overrides.get(name) in mds_writer.SCALARS:  # declared numeric: values are parsed, wrong ones are bad rows
                numeric.append(name)
                encodings[name] = "float64"
            else:
                undeclared_text.append(name)
                categorical.append(name)
                encodings[name] = "str"
            continue
        values = first.table.column(name)
        sample = next((v for v in values.to_pylist() if v is not None), None) if pa.types.is_binary(kind) else None
        try:
            encoding = mds_writer.infer_encoding(name, kind, sample)
        except DataError:
            raise DataError(
                f"{origin}: feature column {name!r} has type {kind}; features must be numeric (integer, float, "
                f"bool), string (categorical), images or fixed-shape arrays. Drop or convert the column."
            ) from None
        if inp.fmt == "image_folder" and encoding == "bytes":
            encoding = "png"  # the first image is not PNG or JPEG: store PNG; undecodable ones are bad rows
        if encoding in mds_writer.SCALARS:
            numeric.append(name)
        elif encoding in ("png", "jpeg") or (inp.fmt in ("idx", "image_folder") and name == "image"):
            images.append(name)
        elif encoding == "bytes":
            raise DataError(f"{origin}: column {name!r} holds binary values that are not PNG or JPEG images; "
                            f"expected images, or drop the column")
        else:
            arrays.append(name)
        encodings[name] = encoding

    if undeclared_text:
        sample_batches = [first, *_more_rows(rest, schema, TEXT_SAMPLE_ROWS - first.table.num_rows)]
        for name in undeclared_text:
            check_text_feature(name, sample_batches)
    rest.close()  # the open file of the unit it stopped in

    for column, encoding in overrides.items():
        if column not in encodings:
            raise ConfigError(f"data.column_encodings: {column!r} is not a column; the columns are {columns}")
        allowed = _allowed_overrides(column, encodings[column], numeric, images, label_kind == "int" and column == cfg.label_column)
        if encoding not in allowed:
            raise ConfigError(f"data.column_encodings: column {column!r} cannot be stored as {encoding!r}; "
                              f"expected one of {allowed}")
        encodings[column] = encoding

    return Plan(
        fmt=inp.fmt, columns=columns, label_column=cfg.label_column, label_kind=label_kind, key_column=cfg.key_column,
        numeric_columns=numeric, categorical_columns=categorical, image_columns=images, array_columns=arrays,
        encodings=encodings, declared_classes=list(cfg.label_classes),
        text_columns=columns if inp.fmt == "csv" else [], on_bad_rows=cfg.on_bad_rows,
        val_fraction=cfg.val_fraction, test_fraction=cfg.test_fraction, split_seed=cfg.split_seed,
        compression=None if cfg.compression == "none" else cfg.compression, size_limit=cfg.shard_size_limit_bytes,
        batch_rows=cfg.batch_rows, parent_pid=os.getpid(),
        time_split=splits.plan_time_split(cfg, inp, units, origin) if time_split else None,
        file_split=splits.plan_file_split(cfg, inp),
    )


def _first_batch(inp: Input, units: list[Unit]):
    """The first non-empty batch of the input, and the batches after it (a lazy iterator over the units)."""
    def batches():
        for unit in units:
            yield from sources.read_unit(unit, inp.fmt, batch_rows=_SCHEMA_BATCH_ROWS)

    rest = batches()
    for batch in rest:
        if batch.table.num_rows:
            return batch, rest
    return None, rest


def _more_rows(batches: Iterator[Batch], schema, rows: int) -> list[Batch]:
    """Up to about ``rows`` more rows of the first batch's ``schema``. A batch that does not read (a
    CSV column changing type further down) or has another schema ends the sample: the conversion
    reports those rows and files one by one."""
    out = []
    while rows > 0:
        try:
            batch = next(batches, None)
        except DataError:
            break
        if batch is None or not batch.table.schema.equals(schema):
            break
        out.append(batch)
        rows -= batch.table.num_rows
    return out


def check_text_feature(name: str, batches: list[Batch]) -> None:
    """Fail unless the sampled values of text feature column ``name`` look like categories: not
    numbers stored as text, not a distinct value per row (see NUMERIC_TEXT_FRACTION)."""
    values, where = [], []
    for b, batch in enumerate(batches):
        column = batch.table.column(name).to_pylist()
        present = [i for i, v in enumerate(column) if v is not None]
        values += [column[i] for i in present]
        where += [(b, i) for i in present]
    if not values:
        return
    _, not_numbers = text_to_numbers(np.array(values, dtype=object).astype(str))
    n, numbers, distinct = len(values), int((~not_numbers).sum()), len(set(values))
    wrong = np.flatnonzero(not_numbers)
    if numbers >= NUMERIC_TEXT_FRACTION * n:
        at = int(wrong[0]) if len(wrong) else 0
        if len(wrong):
            problem = (f"value {values[at]!r}; expected a number: {numbers:,} of the column's first {n:,} values are "
                       f"numbers stored as text")
        else:
            problem = (f"value {values[at]!r} is a number stored as text, as are all of the column's first {n:,} "
                       f"values")
    elif n >= DISTINCT_MIN_VALUES and distinct >= DISTINCT_FRACTION * n:
        at = int(wrong[0]) if numbers and len(wrong) else 0
        problem = (f"value {values[at]!r} is one of {distinct:,} distinct values in the column's first {n:,} "
                   f"values: as a categorical feature that is a category per row or nearly")
    else:
        return
    b, i = where[at]
    hint = "; or, if it identifies rows, name it data.key_column" if numbers < NUMERIC_TEXT_FRACTION * n else ""
    raise DataError(
        f"{batches[b].where(i)}, column {name!r}: {problem}. Declare the column: numeric with "
        f"data.column_encodings ['{name}:float64'] (a value that is not a number is then a bad row), or "
        f"categorical with data.categorical_columns ['{name}']{hint}"
    )


def is_text(kind) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _allowed_overrides(column: str, inferred: str, numeric: list[str], images: list[str], int_label: bool) -> list[str]:
    if column in numeric:
        return list(mds_writer.SCALARS)
    if column in images:
        return sorted({inferred, "png", "jpeg"})
    if int_label:
        return [e for e in mds_writer.SCALARS if e.startswith(("int", "uint"))]
    return [inferred]


def check_columns(names: list[str], expected: list[str], origin: str) -> None:
    missing = [c for c in expected if c not in names]
    unexpected = [c for c in names if c not in expected]
    if missing or unexpected:
        problems = ([f"missing column(s) {missing}"] if missing else []) + (
            [f"unexpected column(s) {unexpected}"] if unexpected else [])
        raise DataError(f"{origin}: {' and '.join(problems)}; expected the columns {expected}")
