"""Input sources: find the files behind a path or fsspec URI, cut them into work units, read Arrow batches.

Formats: Parquet (files, folders, hive partitions ``key=value/``), CSV, JSON Lines, IDX image/label
pairs (MNIST, FashionMNIST) and image folders (one sub-folder per class). Every reader yields record
batches of bounded size, so no input is ever held in memory whole.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Iterator

import numpy as np

from pipeline.data import local_path
from pipeline.data.types import Batch, Input, SourceFile, Unit, key_hashes, position_keys
from pipeline.errors import DataError

FORMATS = ("parquet", "csv", "jsonl", "idx", "image_folder")
_SUFFIX_FORMAT = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_IDX_IMAGES = re.compile(r"^(?P<prefix>.*)-images-idx3-ubyte(\.gz)?$")
_IDX_LABELS = "{prefix}-labels-idx1-ubyte"


def open_input(input_path: str, fmt: str = "auto") -> Input:
    """The files behind ``input_path`` (a file, a folder searched recursively, or a URI), sorted."""
    import fsspec

    if not input_path:
        raise DataError("data.input_path is empty: expected a file, a folder or a URI (file://, s3://, ...)")
    try:
        # fsspec keeps a file URI's percent-escapes (a space stays %20): local files go by their path.
        fs, root = fsspec.core.url_to_fs(str(local_path(input_path)) if input_path.startswith("file:") else input_path)
    except (ImportError, ValueError) as exc:
        raise DataError(f"data.input_path {input_path!r}: no filesystem for it ({exc}); install the fsspec "
                        f"package of that store (s3fs, gcsfs, adlfs)") from exc
    if not fs.exists(root):
        raise DataError(f"data.input_path {input_path!r} does not exist: expected a file, a folder or a URI")
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]

    def uri(path: str) -> str:
        return path if protocol in ("file", "local") else f"{protocol}://{path}"

    if fs.isdir(root):
        found = fs.find(root, detail=True)
        base = root.rstrip("/") + "/"
        listed = [
            SourceFile(uri(p), p[len(base):] if p.startswith(base) else p, int(info.get("size") or 0))
            for p, info in sorted(found.items())
        ]
        listed = [f for f in listed if not any(part.startswith((".", "_")) for part in PurePosixPath(f.relpath).parts)]
    else:
        listed = [SourceFile(uri(root), PurePosixPath(root).name, int(fs.size(root) or 0))]
    fmt = _detect(input_path, listed) if fmt == "auto" else fmt
    files = _select(input_path, listed, fmt)
    return Input(fmt=fmt, root=uri(root), files=files)


def _detect(input_path: str, files: list[SourceFile]) -> str:
    if any(_IDX_IMAGES.match(PurePosixPath(f.relpath).name) for f in files):
        return "idx"
    kinds = sorted({_SUFFIX_FORMAT[_suffix(f)] for f in files if _suffix(f) in _SUFFIX_FORMAT})
    if not kinds and any(_suffix(f) in IMAGE_SUFFIXES and len(PurePosixPath(f.relpath).parts) >= 2 for f in files):
        return "image_folder"  # images in class sub-folders, and no table files beside them
    if len(kinds) == 1:
        return kinds[0]
    if not kinds:
        raise DataError(
            f"data.input_path {input_path!r}: found no input files (*.parquet, *.csv, *.jsonl, "
            f"*-images-idx3-ubyte[.gz], or CLASS/*.png|jpg folders)"
        )
    raise DataError(f"data.input_path {input_path!r} mixes formats {kinds}; set data.format to pick one")


def _suffix(f: SourceFile) -> str:
    name = PurePosixPath(f.relpath).name.lower()
    for compressed in (".gz", ".bz2", ".zst"):
        if name.endswith(compressed):
            name = name[: -len(compressed)]
    return PurePosixPath(name).suffix


def _select(input_path: str, files: list[SourceFile], fmt: str) -> list[SourceFile]:
    if fmt == "idx":
        by_name = {PurePosixPath(f.relpath).name.removesuffix(".gz"): f for f in files}
        out = []
        for f in files:
            match = _IDX_IMAGES.match(PurePosixPath(f.relpath).name)
            if not match:
                continue
            labels = by_name.get(_IDX_LABELS.format(prefix=match["prefix"]))
            if labels is None:
                raise DataError(f"{f.uri}: no labels file {_IDX_LABELS.format(prefix=match['prefix'])}[.gz] beside it")
            out.append(SourceFile(f.uri, f.relpath, f.size, partner=labels.uri))
    elif fmt == "image_folder":
        out = [f for f in files if _suffix(f) in IMAGE_SUFFIXES and len(PurePosixPath(f.relpath).parts) >= 2]
    else:
        out = [f for f in files if _SUFFIX_FORMAT.get(_suffix(f)) == fmt]
    if not out:
        raise DataError(f"data.input_path {input_path!r} has no {fmt} input files")
    return out


# --- hive partitions and data intervals ---------------------------------------------------------

def partition_value(relpath: str, key: str) -> str | None:
    for part in PurePosixPath(relpath).parts[:-1]:
        name, sep, value = part.partition("=")
        if sep and name == key:
            return value
    return None


def select_interval(inp: Input, key: str, start: str, end: str) -> Input:
    """Keep the files whose partition ``key=VALUE`` (a date or timestamp) lies in ``[start, end)``."""
    lo, hi = _instant(start, "interval start"), _instant(end, "interval end")
    kept = []
    for f in inp.files:
        value = partition_value(f.relpath, key)
        if value is None:
            raise DataError(f"{f.uri}: not under a {key}=VALUE partition folder; a data interval selects "
                            f"input by that folder (or set data.partition_key)")
        if lo <= _instant(value, f"{f.uri}: partition {key}") < hi:
            kept.append(f)
    if not kept:
        raise DataError(f"{inp.root}: no {key}=... partition in the data interval [{start}, {end}): empty input")
    return Input(fmt=inp.fmt, root=inp.root, files=kept)


def _instant(text: str, what: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise DataError(f"{what} {text!r}: expected an ISO date or timestamp such as 2026-11-29") from None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


# --- work units ---------------------------------------------------------------------------------

def plan_units(inp: Input, *, unit_bytes: int) -> list[Unit]:
    """Cut the input into units of about ``unit_bytes`` uncompressed bytes that workers convert
    independently; the cut depends on the input only, so the output is the same for any number of
    workers."""
    units: list[Unit] = []
    if inp.fmt == "parquet":
        for f in inp.files:
            meta = _parquet_file(f).metadata
            start, size = 0, 0
            for g in range(meta.num_row_groups):
                size += meta.row_group(g).total_byte_size
                if size >= unit_bytes:
                    units.append(Unit(len(units), (f,), start, g + 1, size))
                    start, size = g + 1, 0
            if start < meta.num_row_groups or meta.num_row_groups == 0:
                units.append(Unit(len(units), (f,), start, meta.num_row_groups, size))
    elif inp.fmt == "idx":
        for f in inp.files:
            count, row_bytes = _idx_count(f)
            rows = max(1, unit_bytes // row_bytes)
            for start in range(0, max(count, 1), rows):
                stop = min(start + rows, count)
                units.append(Unit(len(units), (f,), start, stop, (stop - start) * row_bytes))
    elif inp.fmt == "image_folder":
        start, size = 0, 0
        for i, f in enumerate(inp.files):
            size += f.size
            if size >= unit_bytes or i == len(inp.files) - 1:
                units.append(Unit(len(units), tuple(inp.files[start:i + 1]), size_bytes=size))
                start, size = i + 1, 0
    else:  # CSV and JSON Lines stream from the start: one unit per file (compressed ones count their file size)
        units = [Unit(i, (f,), size_bytes=f.size) for i, f in enumerate(inp.files)]
    return units


def read_unit(unit: Unit, fmt: str, *, batch_rows: int, string_columns: list[str] | None = None) -> Iterator[Batch]:
    """Record batches of one unit. ``string_columns`` are read as text (CSV), so a value of the wrong
    type is found and reported per row instead of failing the whole file."""
    if fmt == "parquet":
        yield from _read_parquet(unit, batch_rows)
    elif fmt == "csv":
        yield from _read_csv(unit.files[0], batch_rows, string_columns or [])
    elif fmt == "jsonl":
        yield from _read_jsonl(unit.files[0], batch_rows)
    elif fmt == "idx":
        yield from _read_idx(unit, batch_rows)
    elif fmt == "image_folder":
        yield from _read_images(unit, batch_rows)
    else:
        raise DataError(f"data.format {fmt!r}: expected one of {FORMATS}")


def _open(uri: str, compression: str | None = "infer"):
    import fsspec

    return fsspec.open(uri, "rb", compression=compression).open()


def _parquet_file(f: SourceFile):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(_open(f.uri, None))
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{f.uri}: not a readable Parquet file ({exc})") from exc


def _read_parquet(unit: Unit, batch_rows: int) -> Iterator[Batch]:
    f = unit.files[0]
    pf = _parquet_file(f)
    groups = list(range(unit.start, unit.stop))
    row = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start))
    if not groups:
        return
    for batch in pf.iter_batches(batch_size=batch_rows, row_groups=groups):
        yield Batch(batch, [f.uri], row, position_keys(f.relpath, row, batch.num_rows))
        row += batch.num_rows


def _read_csv(f: SourceFile, batch_rows: int, string_columns: list[str]) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    # Rows per block are unknown up front; ~100 bytes a row is a fair guess for tabular text.
    read = pcsv.ReadOptions(block_size=max(1 << 16, min(batch_rows * 100, 1 << 26)))
    convert = pcsv.ConvertOptions(column_types={c: pa.string() for c in string_columns}, strings_can_be_null=True)
    row = 0
    try:
        reader = pcsv.open_csv(_open(f.uri), read_options=read, convert_options=convert)
        for batch in reader:
            yield Batch(batch, [f.uri], row, position_keys(f.relpath, row, batch.num_rows))
            row += batch.num_rows
    except pa.ArrowInvalid as exc:
        raise DataError(f"{f.uri}: not readable as CSV after row {row} ({exc})") from exc


def _read_jsonl(f: SourceFile, batch_rows: int) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.json as pjson

    row = 0
    try:
        reader = pjson.open_json(_open(f.uri), read_options=pjson.ReadOptions(block_size=max(1 << 16, min(batch_rows * 200, 1 << 26))))
        for batch in reader:
            yield Batch(batch, [f.uri], row, position_keys(f.relpath, row, batch.num_rows))
            row += batch.num_rows
    except pa.ArrowInvalid as exc:
        # Arrow's message names the JSON column and the row where a value changed type.
        raise DataError(f"{f.uri}: not readable as JSON Lines after row {row} ({exc}); each line must be "
                        f"one JSON object and a column keeps one type") from exc


def read_idx(uri: str, expected_magic: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows ``[start, stop)`` of an IDX file (images [n, rows, cols] or labels [n]), the header checked.

    A plain file is read at the rows' offset; a gzipped one is decompressed up to them, which is why
    ``stage_idx`` decompresses gzipped files once before workers share them out.
    """
    with _open(uri) as fh:
        dims = _idx_header(fh, uri, expected_magic)
        item = int(np.prod(dims[1:]))
        stop = dims[0] if stop is None else min(stop, dims[0])
        fh.seek(4 + 4 * len(dims) + start * item)
        want = (stop - start) * item
        data = fh.read(want)
    if len(data) != want:
        raise DataError(f"{uri}: header says {dims}, the data ends inside row {start + len(data) // max(item, 1)}; "
                        f"the file is truncated or not IDX")
    return np.frombuffer(data, dtype=np.uint8).reshape((stop - start, *dims[1:]))


def _idx_header(fh, uri: str, expected_magic: int) -> list[int]:
    head = fh.read(4)
    magic = int.from_bytes(head, "big") if len(head) == 4 else None
    if magic != expected_magic:
        shown = f"{magic:#010x}" if magic is not None else "missing"
        raise DataError(f"{uri}: IDX magic number {shown}; expected {expected_magic:#010x} "
                        f"({'images' if expected_magic == 0x803 else 'labels'}, unsigned bytes)")
    ndim = head[3]
    raw = fh.read(4 * ndim)
    if len(raw) != 4 * ndim:
        raise DataError(f"{uri}: the IDX header is cut short; the file is truncated or not IDX")
    return [int.from_bytes(raw[4 * i: 4 * i + 4], "big") for i in range(ndim)]


def _idx_count(f: SourceFile) -> tuple[int, int]:
    """Images in an IDX pair, and bytes per image and label."""
    with _open(f.uri) as fh:
        dims = _idx_header(fh, f.uri, 0x803)
    with _open(f.partner) as fh:
        labels = _idx_header(fh, f.partner, 0x801)[0]
    if labels != dims[0]:
        raise DataError(f"{f.partner}: {labels} labels for {dims[0]} images in {f.uri}; expected one label per image")
    return dims[0], int(np.prod(dims[1:])) + 1


def stage_idx(units: list[Unit], folder: Path) -> list[Unit]:
    """Gzipped or remote IDX files decompressed once into local plain files, so that each worker reads
    only its own rows instead of decompressing (or downloading) whole files again."""
    import shutil

    copies: dict[str, str] = {}

    def local(uri: str) -> str:
        if uri not in copies:
            if not uri.endswith(".gz") and "://" not in uri:
                copies[uri] = uri
            else:
                folder.mkdir(parents=True, exist_ok=True)
                target = folder / f"{len(copies):04d}.idx"
                with _open(uri) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                copies[uri] = str(target)
        return copies[uri]

    return [Unit(u.index, tuple(SourceFile(f.uri, f.relpath, f.size, f.partner, (local(f.uri), local(f.partner)))
                                for f in u.files), u.start, u.stop, u.size_bytes) for u in units]


def _read_idx(unit: Unit, batch_rows: int) -> Iterator[Batch]:
    import pyarrow as pa

    f = unit.files[0]
    images_at, labels_at = f.staged or (f.uri, f.partner)
    for start in range(unit.start, unit.stop, batch_rows):
        stop = min(start + batch_rows, unit.stop)
        images = read_idx(images_at, 0x803, start, stop)
        labels = read_idx(labels_at, 0x801, start, stop)
        shape = images.shape[1:]
        flat = pa.FixedSizeListArray.from_arrays(pa.array(images.reshape(-1)), int(np.prod(shape)))
        table = pa.record_batch({
            "image": pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.uint8(), shape), flat),
            "label": pa.array(labels.astype(np.int64)),
        })
        yield Batch(table, [f.uri], start, position_keys(f.relpath, start, stop - start))


def _read_images(unit: Unit, batch_rows: int) -> Iterator[Batch]:
    import pyarrow as pa

    for start in range(0, len(unit.files), batch_rows):
        chunk = unit.files[start:start + batch_rows]
        blobs = []
        for f in chunk:
            with _open(f.uri, None) as fh:
                blobs.append(fh.read())
        labels = [PurePosixPath(f.relpath).parts[-2] for f in chunk]
        table = pa.record_batch({"image": pa.array(blobs, pa.binary()), "label": pa.array(labels, pa.string())})
        # An image's split follows its own path: adding images never moves the others.
        yield Batch(table, [f.uri for f in chunk], -1, key_hashes([f.relpath for f in chunk]))
