"""Row validation: a batch as the MDS columns expect it, and its bad rows with where and why."""

from __future__ import annotations

import io

import numpy as np

from pipeline.data import images
from pipeline.data.prepare import mds_writer
from pipeline.data.prepare.plan import Batch, Plan, as_text, text_to_numbers
from pipeline.errors import DataError

BAD_EXAMPLES = 5  # bad rows quoted per worker, in the log and in the error of a run over data.max_bad_fraction


def conform(batch: Batch, plan: Plan):
    """The batch as the MDS columns expect it, and its bad rows as ``(row, column, problem)``, first
    problem per row, in row order."""
    import pyarrow as pa

    problems: dict[int, tuple[str, str]] = {}

    def flag(mask: np.ndarray, column: str, describe) -> None:
        for i in np.flatnonzero(mask):
            problems.setdefault(int(i), (column, describe(int(i))))

    out = {}
    for name in plan.columns:
        column = batch.table.column(name)
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        if plan.transform is not None:  # the row transform reads (and checks) its input columns
            out[name] = column
            continue
        encoding = plan.encodings[name]
        try:
            if name in plan.numeric_columns:
                out[name] = _numbers(column, encoding, name, flag, "a finite number")
            elif name == plan.label_column:
                out[name] = _label(column, plan, flag)
            elif name in plan.image_columns:
                out[name] = _images(column, encoding, name, flag)
            elif name in plan.array_columns:
                out[name] = _arrays(column, name, flag)
            else:  # categorical or key: text, missing as ""
                if name == plan.key_column:
                    flag(column.is_null().to_numpy(zero_copy_only=False), name, lambda i: "key is null; expected a value")
                out[name] = as_text(column)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, AttributeError) as exc:
            # A file whose column has another type than the first file's, with no per-value reading.
            raise DataError(f"{batch.origins[0]}: column {name!r} has type {column.type}, which does not convert "
                            f"to the column's encoding {encoding!r} ({exc})") from None
    return pa.table(out), [(i, *problems[i]) for i in sorted(problems)]


def _numbers(column, encoding: str, name: str, flag, expected: str):
    """Numbers of ``encoding``; text is parsed per value (CSV), so a wrong value is one bad row."""
    import pyarrow as pa

    null = column.is_null().to_numpy(zero_copy_only=False)
    flag(null, name, lambda i: f"value is null; expected {expected}")
    integral = encoding.startswith(("int", "uint"))
    if pa.types.is_integer(column.type) or pa.types.is_boolean(column.type):
        if integral:
            return pa.array(column.fill_null(0).cast(pa.int64()).to_numpy(zero_copy_only=False).astype(encoding))
        values = column.cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False)
    elif pa.types.is_floating(column.type):
        values = column.cast(pa.float64()).to_numpy(zero_copy_only=False)
    else:
        text = as_text(column).to_numpy(zero_copy_only=False)
        values, not_numbers = text_to_numbers(text)
        flag(not_numbers & ~null, name, lambda i: f"value {text[i]!r}; expected {'an integer' if integral else 'a number'}")
    finite = np.isfinite(values)
    flag(~finite & ~null, name, lambda i: f"value {float(values[i])!r}; expected {expected}")
    if integral:
        whole = finite & (values == np.round(values))
        flag(finite & ~whole, name, lambda i: f"value {float(values[i])!r}; expected an integer")
        return pa.array(np.where(whole, values, 0).astype(encoding))
    return pa.array(np.where(finite, values, 0.0).astype(encoding))


def _label(column, plan: Plan, flag):
    import pyarrow as pa

    name = plan.label_column
    if plan.label_kind == "int":
        values = _numbers(column, plan.encodings[name], name, flag, "an integer class label")
    else:
        null = column.is_null().to_numpy(zero_copy_only=False)
        flag(null, name, lambda i: "label is null; expected a class label")
        values = as_text(column)
    if plan.declared_classes:
        text = [str(v) for v in values.to_pylist()]
        allowed = set(plan.declared_classes)
        outside = np.array([t not in allowed for t in text], dtype=bool)
        flag(outside, name, lambda i: f"label {text[i]!r}; expected one of {plan.declared_classes}")
    return values if isinstance(values, pa.Array) else pa.array(values)


def _images(column, encoding: str, name: str, flag):
    """Every image decoded once (a truncated or foreign file is a bad row), re-encoded only when its
    format differs from the column's encoding."""
    import pyarrow as pa
    from PIL import Image

    if encoding.startswith("ndarray:"):
        return column
    if isinstance(column.type, pa.FixedShapeTensorType):
        arrays = column.to_numpy_ndarray()
        return pa.array([_encode_image(Image.fromarray(a), encoding) for a in arrays], pa.binary())
    blobs = column.to_pylist()
    out = []
    for i, blob in enumerate(blobs):
        if blob is None:
            flag(np.arange(len(blobs)) == i, name, lambda _: "image is null; expected a PNG or JPEG image")
            out.append(b"")
            continue
        try:
            with images.open_image(blob) as image:
                if mds_writer.image_format(blob) != encoding:
                    blob = _encode_image(image, encoding)
        except images.BadImage as exc:
            flag(np.arange(len(blobs)) == i, name, lambda _, p=str(exc): p)
            blob = b""
        except (OSError, ValueError) as exc:  # decodes, but cannot be written as the column's encoding
            problem = f"value of {len(blob)} bytes decodes but does not encode as {encoding} ({exc})"
            flag(np.arange(len(blobs)) == i, name, lambda _, p=problem: p)
            blob = b""
        out.append(blob)
    return pa.array(out, pa.binary())


def _encode_image(image, encoding: str) -> bytes:
    out = io.BytesIO()
    if encoding == "jpeg" and image.mode not in ("L", "RGB"):
        image = image.convert("RGB")
    image.save(out, format="PNG" if encoding == "png" else "JPEG")
    return out.getvalue()


def _arrays(column, name: str, flag):
    import pyarrow as pa

    null = column.is_null().to_numpy(zero_copy_only=False)
    flag(null, name, lambda i: "array is null; expected a fixed-shape array")
    storage = column.storage if isinstance(column, pa.ExtensionArray) else column
    width = storage.type.list_size
    values = storage.flatten().to_numpy(zero_copy_only=False)
    if values.dtype.kind == "f" and len(values) == len(column) * width:
        bad = ~np.isfinite(values.reshape(len(column), width)).all(axis=1)
        flag(bad, name, lambda i: "array holds NaN or inf; expected finite numbers")
    return column


def quarantine_rows(batch: Batch, problems: list[tuple[int, str, str]]):
    """The bad rows as they came (text, images as bytes) with where and why, for quarantine.parquet."""
    import pyarrow as pa

    rows = pa.array([r for r, _, _ in problems])
    picked = batch.table.take(rows)
    out = {}
    for name in picked.schema.names:
        column = picked.column(name)
        if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            out[name] = column.cast(pa.binary())
        else:
            try:
                out[name] = column.cast(pa.string())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                out[name] = pa.array([None if v is None else str(v) for v in column.to_pylist()], pa.string())
    out["_source"] = pa.array([batch.where(r) for r, _, _ in problems], pa.string())
    out["_column"] = pa.array([c for _, c, _ in problems], pa.string())
    out["_error"] = pa.array([p for _, _, p in problems], pa.string())
    return pa.table(out)
