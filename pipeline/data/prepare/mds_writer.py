"""MDS columns from Arrow: encodings inferred from the schema, whole batches encoded with numpy.

``MDSWriter.write`` encodes one sample at a time through a Python call per column; here a whole
record batch becomes the samples' bytes in a few vectorised numpy operations (the byte layout
``MDSWriter.encode_sample`` produces), and ``PartWriter`` cuts them into shards as ``MDSWriter`` does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.data.versions.integrity import ALGORITHM, digest_bytes
from pipeline.diskspace import space_checked
from pipeline.errors import ConfigError, DataError

SCALARS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64")
VARIABLE = ("str", "bytes", "png", "jpeg")
HASHES = [ALGORITHM]  # each file's digest in index.json, copied into the manifest (see integrity)


def infer_encoding(name: str, kind: pa.DataType, first_value: Any = None) -> str:
    """The MDS encoding for an Arrow column; a type with no faithful encoding is refused."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_boolean(kind):
        return "uint8"
    if pa.types.is_integer(kind):
        return "int64"
    if pa.types.is_floating(kind):
        return "float32" if kind.bit_width == 32 else "float64"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "str"
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return image_format(first_value) or "bytes"
    if isinstance(kind, pa.FixedShapeTensorType):
        return _ndarray(name, kind.value_type, tuple(kind.shape))
    if pa.types.is_fixed_size_list(kind):
        return _ndarray(name, kind.value_type, (kind.list_size,))
    raise DataError(
        f"column {name!r} has type {kind}, which has no MDS encoding here; expected integers, floats, "
        f"booleans, strings, binary (images or bytes) or fixed-shape arrays. Drop or convert the column."
    )


def _ndarray(name: str, value_type: pa.DataType, shape: tuple[int, ...]) -> str:
    dtype = value_type.to_pandas_dtype().__name__ if hasattr(value_type, "to_pandas_dtype") else str(value_type)
    if dtype not in SCALARS:
        raise DataError(f"column {name!r}: arrays of {value_type} have no MDS encoding; expected numeric values")
    return f"ndarray:{dtype}:{','.join(str(d) for d in shape)}"


def image_format(blob: Any) -> str | None:
    if isinstance(blob, (bytes, bytearray)):
        if blob[:8] == b"\x89PNG\r\n\x1a\n":
            return "png"
        if blob[:3] == b"\xff\xd8\xff":
            return "jpeg"
    return None


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``["x0:float32", "image:jpeg"]`` -> ``{"x0": "float32", "image": "jpeg"}``, each one checked."""
    out = {}
    for item in items:
        column, sep, encoding = item.partition(":")
        if not sep or not column:
            raise ConfigError(f"data.column_encodings entry {item!r}: expected COLUMN:ENCODING, e.g. x0:float32")
        check_encoding(encoding, where=f"data.column_encodings {item!r}")
        out[column] = encoding
    return out


def check_encoding(encoding: str, *, where: str) -> None:
    if encoding == "pkl":
        raise ConfigError(f"{where}: pickle columns are refused (unpickling runs code from the data); "
                          f"use one of {SCALARS + VARIABLE} or ndarray:DTYPE:SHAPE")
    if encoding in SCALARS or encoding in VARIABLE:
        return
    parts = encoding.split(":")
    if len(parts) == 3 and parts[0] == "ndarray" and parts[1] in SCALARS and all(
            d.isdigit() and int(d) > 0 for d in parts[2].split(",")):
        return
    raise ConfigError(f"{where}: encoding {encoding!r} is not supported; expected one of {SCALARS + VARIABLE} "
                      f"or ndarray:DTYPE:SHAPE with a fixed shape, e.g. ndarray:uint8:28,28")


def fixed_size(encoding: str) -> int | None:
    if encoding in SCALARS:
        return np.dtype(encoding).itemsize
    if encoding.startswith("ndarray:"):
        _, dtype, shape = encoding.split(":")
        return np.dtype(dtype).itemsize * int(np.prod([int(d) for d in shape.split(",")]))
    return None


def encode_batch(columns: dict[str, str], table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """The MDS bytes of every row of ``table``: one flat uint8 buffer and the row boundaries (n + 1).

    Byte-for-byte what ``MDSWriter.encode_sample`` writes: a uint32 size per variable-size column,
    then each column's bytes, columns in sorted name order. Columns must already hold the encoding's
    values (see ``prep``): scalars of the right type, strings/binaries without nulls, flat arrays.
    """
    n = table.num_rows
    names = sorted(columns)
    parts: list[tuple[str, Any]] = []  # ("fixed", uint8[n, w]) or ("var", (offsets[n+1], data))
    for name in names:
        encoding, column = columns[name], table.column(name)
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        width = fixed_size(encoding)
        if encoding in SCALARS:
            values = np.ascontiguousarray(column.to_numpy(zero_copy_only=False), dtype=encoding)
            parts.append(("fixed", values.view(np.uint8).reshape(n, width)))
        elif width is not None:  # ndarray:DTYPE:SHAPE
            storage = column.storage if isinstance(column, pa.ExtensionArray) else column
            dtype = encoding.split(":")[1]
            values = np.ascontiguousarray(storage.flatten().to_numpy(zero_copy_only=False), dtype=dtype)
            parts.append(("fixed", values.view(np.uint8).reshape(n, width)))
        else:
            kind = pa.large_string() if encoding == "str" else pa.large_binary()
            column = column.cast(kind)
            offsets = np.frombuffer(column.buffers()[1], dtype=np.int64)[column.offset:column.offset + n + 1]
            data = np.frombuffer(column.buffers()[2], dtype=np.uint8) if column.buffers()[2] is not None \
                else np.zeros(0, np.uint8)
            parts.append(("var", (offsets, data)))

    if all(kind == "fixed" for kind, _ in parts):  # every row the same length: fill columns of a 2-D view
        widths = [value.shape[1] for _, value in parts]
        rows = np.empty((n, sum(widths)), np.uint8)
        at = 0
        for (_, value), width in zip(parts, widths):
            rows[:, at:at + width] = value
            at += width
        return rows.reshape(-1), np.arange(n + 1, dtype=np.int64) * at

    var_sizes = [np.diff(p[1][0]) for p in parts if p[0] == "var"]
    head = np.stack(var_sizes, axis=1).astype(np.uint32) if var_sizes else np.zeros((n, 0), np.uint32)
    lengths = [p[1].shape[1] * np.ones(n, np.int64) if p[0] == "fixed" else np.diff(p[1][0]) for p in parts]
    row_len = head.shape[1] * 4 + (np.sum(lengths, axis=0) if lengths else np.zeros(n, np.int64))
    bounds = np.zeros(n + 1, np.int64)
    np.cumsum(row_len, out=bounds[1:])
    buf = np.empty(int(bounds[-1]), np.uint8)
    starts = bounds[:-1]
    _scatter_fixed(buf, starts, head.view(np.uint8).reshape(n, -1))
    at = starts + head.shape[1] * 4
    for (kind, value), length in zip(parts, lengths):
        if kind == "fixed":
            _scatter_fixed(buf, at, value)
        else:
            offsets, data = value
            total = int(offsets[-1] - offsets[0])
            if total:
                dst = np.repeat(at - (offsets[:-1] - offsets[0]), length) + np.arange(total)
                buf[dst] = data[offsets[0]:offsets[-1]]
        at = at + length
    return buf, bounds


def _scatter_fixed(buf: np.ndarray, starts: np.ndarray, rows: np.ndarray) -> None:
    if rows.size:
        buf[starts[:, None] + np.arange(rows.shape[1])] = rows


class PartWriter:
    """One MDS sub-dataset (``SPLIT/part-NNNNN/``): shards, their hashes and ``index.json``.

    The files are byte for byte what streaming's ``MDSWriter`` writes for the same samples (a test
    holds it to that), without importing streaming: its package imports torch, which costs each
    worker process ~740 MB and ~4 s for nothing a writer needs. Whole batches are cut into shards
    with numpy instead of one Python call per sample.
    """

    extra_bytes_per_sample = 4  # the sample's offset in the shard header

    def __init__(self, out: Path, columns: dict[str, str], *, compression: str | None, size_limit: int):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.compression = compression
        self.size_limit = size_limit
        names = sorted(columns)
        self.config = {
            "version": 2, "format": "mds", "compression": compression, "hashes": HASHES, "size_limit": size_limit,
            "column_names": names, "column_encodings": [columns[n] for n in names],
            "column_sizes": [fixed_size(columns[n]) for n in names],
        }
        self.config_data = json.dumps(self.config, sort_keys=True).encode("utf-8")
        self.extra_bytes_per_shard = 4 + 4 + len(self.config_data)
        self.shards: list[dict[str, Any]] = []
        self.rows = 0
        self._chunks: list[np.ndarray] = []
        self._sizes: list[np.ndarray] = []
        self._shard_size = self.extra_bytes_per_shard

    def write(self, buf: np.ndarray, bounds: np.ndarray, start: int, stop: int) -> None:
        """Append samples ``start:stop`` of an :func:`encode_batch` buffer (row boundaries ``bounds``)."""
        if stop <= start:
            return
        sizes = np.diff(bounds[start:stop + 1])
        data = buf[bounds[start]:bounds[stop]]
        rows = stop - start
        ends = np.cumsum(sizes)
        done = 0
        while done < rows:
            # MDSWriter's rule: a sample that would take the shard past size_limit starts a new one.
            room = self.size_limit - self._shard_size
            used = np.cumsum(sizes[done:] + self.extra_bytes_per_sample)
            fits = int(np.searchsorted(used, room, side="right"))
            if fits == 0:
                if self._sizes:
                    self._flush()
                    continue
                fits = 1  # a sample larger than the limit gets a shard of its own
            first = int(ends[done - 1]) if done else 0
            self._chunks.append(data[first:int(ends[done + fits - 1])])
            self._sizes.append(sizes[done:done + fits])
            self._shard_size += int(used[fits - 1])
            done += fits
        self.rows += rows

    def _flush(self) -> None:
        sizes = np.concatenate(self._sizes)
        offsets = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        offsets += 4 + 4 * len(offsets) + len(self.config_data)
        raw = b"".join([np.uint32(len(sizes)).tobytes(), offsets.astype(np.uint32).tobytes(), self.config_data,
                        *(c.tobytes() for c in self._chunks)])
        raw_name = f"shard.{len(self.shards):05}.mds"
        entry = {"samples": len(sizes), "raw_data": _file_info(raw, raw_name), "zip_data": None, **self.config}
        data = raw
        if self.compression:
            data = _compress(self.compression, raw)
            entry["zip_data"] = _file_info(data, f"{raw_name}.{self.compression}")
        path = self.out / (entry["zip_data"] or entry["raw_data"])["basename"]
        with space_checked(path, len(data)):  # the preparation's temporary folder goes with a failure
            path.write_bytes(data)
        self.shards.append(entry)
        self._chunks, self._sizes, self._shard_size = [], [], self.extra_bytes_per_shard

    def finish(self) -> None:
        if self._sizes:
            self._flush()
        (self.out / "index.json").write_text(json.dumps({"version": 2, "shards": self.shards}, sort_keys=True))


def _file_info(data: bytes, basename: str) -> dict[str, Any]:
    return {"basename": basename, "bytes": len(data), "hashes": {ALGORITHM: digest_bytes(data)}}


def _compress(algo: str, data: bytes) -> bytes:
    # streaming's default levels (zstd 3, gzip 9, bz2 9); gzip without a timestamp, so that the same
    # samples always give the same bytes and hashes.
    if algo == "zstd":
        import zstd

        return zstd.compress(data, 3)
    if algo == "gz":
        import gzip

        return gzip.compress(data, 9, mtime=0)
    if algo == "bz2":
        import bz2

        return bz2.compress(data, 9)
    raise ConfigError(f"compression {algo!r}: expected zstd, gz, bz2 or none")


def merge_parts(split_dir: Path) -> list[dict[str, Any]]:
    """Merge ``split_dir/part-*/index.json`` into ``split_dir/index.json``; return the shard entries.

    What ``streaming.base.util.merge_index`` does (shard paths prefixed by their part folder, parts
    in order), here so the parent need not import streaming either. Parts that got no rows are removed.
    """
    shards = []
    for part in sorted(split_dir.glob("part-*")):
        index = json.loads((part / "index.json").read_text())
        if not index["shards"]:
            shutil.rmtree(part)
            continue
        for shard in index["shards"]:
            for key in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
                if shard.get(key):
                    shard[key]["basename"] = f"{part.name}/{shard[key]['basename']}"
            shards.append(shard)
    split_dir.mkdir(parents=True, exist_ok=True)
    (split_dir / "index.json").write_text(json.dumps({"version": 2, "shards": shards}, sort_keys=True))
    return shards
