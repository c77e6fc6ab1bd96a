"""Input sources: find the files behind a path or fsspec URI, cut them into work units, read Arrow batches.

Formats: Parquet (files, folders, hive partitions ``key=value/``), CSV, JSON Lines, IDX image/label
pairs (MNIST, FashionMNIST) and image folders (one sub-folder per class). Every reader yields record
batches of bounded size, so no input is ever held in memory whole.
"""

from __future__ import annotations

import contextlib
import re
from datetime import datetime, timezone
from pathlib import PurePosixPath
from typing import Iterator

from pipeline.data import local_path, open_uri
from pipeline.data.prepare import idx
from pipeline.data.prepare.plan import (
    Batch,
    Input,
    SourceFile,
    Unit,
    key_hashes,
    position_keys,
)
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
            groups_rows = sum(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
            if groups_rows != meta.num_rows:
                raise DataError(f"{f.uri}: the footer says {meta.num_rows} rows, its row groups {groups_rows}; "
                                f"the file is damaged")
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
            count, row_bytes = idx.count(f)
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
        yield from idx.read_unit(unit, batch_rows)
    elif fmt == "image_folder":
        yield from _read_images(unit, batch_rows)
    else:
        raise DataError(f"data.format {fmt!r}: expected one of {FORMATS}")


def _parquet_file(f: SourceFile):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(open_uri(f.uri, None))
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{f.uri}: not a readable Parquet file ({exc})") from exc


def _read_parquet(unit: Unit, batch_rows: int) -> Iterator[Batch]:
    import pyarrow as pa

    f = unit.files[0]
    pf = _parquet_file(f)
    groups = list(range(unit.start, unit.stop))
    row = first = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start))
    if not groups:
        return
    try:
        for batch in pf.iter_batches(batch_size=batch_rows, row_groups=groups):
            yield Batch(batch, [f.uri], row, position_keys(f.relpath, row, batch.num_rows))
            row += batch.num_rows
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{f.uri}: row group(s) {groups[0]}-{groups[-1]} not readable after row {row} ({exc}); "
                        f"the file is damaged") from exc
    said = sum(pf.metadata.row_group(g).num_rows for g in groups)
    if row - first != said:  # pages that hold other counts than the footer: a damaged file or a broken writer
        raise DataError(f"{f.uri}: row group(s) {groups[0]}-{groups[-1]} hold {row - first} rows from row {first}, "
                        f"the file's footer says {said}; the file is damaged")


def _read_csv(f: SourceFile, batch_rows: int, string_columns: list[str]) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    # Rows per block are unknown up front; ~100 bytes a row is a fair guess for tabular text.
    read = pcsv.ReadOptions(block_size=max(1 << 16, min(batch_rows * 100, 1 << 26)))
    # Arrow's UTF-8 check would turn a column with one Latin-1 value into bytes, or fail a whole block:
    # text is checked per value here instead (_check_text), so that the error names the row.
    convert = pcsv.ConvertOptions(column_types={c: pa.string() for c in string_columns}, strings_can_be_null=True,
                                  check_utf8=False)
    row = 0
    try:
        reader = pcsv.open_csv(open_uri(f.uri), read_options=read, convert_options=convert)
        for batch in reader:
            _check_text(batch, f.uri, row)
            yield Batch(batch, [f.uri], row, position_keys(f.relpath, row, batch.num_rows))
            row += batch.num_rows
    except pa.ArrowInvalid as exc:
        raise DataError(f"{f.uri}: not readable as CSV after row {row} ({exc})") from exc


def _check_text(batch, uri: str, row: int) -> None:
    """Every text value of a CSV batch is UTF-8 and holds no NUL byte (a binary file, or one in UTF-16)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for name, column in zip(batch.schema.names, batch.columns):
        if not pa.types.is_string(column.type):
            continue
        try:
            column.validate(full=True)
        except pa.ArrowInvalid:
            values = column.cast(pa.binary()).to_pylist()
            i = next(i for i, v in enumerate(values) if v is not None and not _is_utf8(v))
            raise DataError(f"{uri}: row {row + i}, column {name!r}: value {values[i]!r} is not UTF-8 text; expected "
                            f"a UTF-8 file (re-encode it: this row looks like another encoding, e.g. Latin-1)") from None
        nul = pc.match_substring(column, "\x00").fill_null(False).to_numpy(zero_copy_only=False)
        if nul.any():
            i = int(nul.argmax())
            raise DataError(f"{uri}: row {row + i}, column {name!r}: value {column[i].as_py()!r} holds a NUL byte; "
                            f"expected text (a NUL is found in binary files and in UTF-16 text, not in a CSV)")


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _read_jsonl(f: SourceFile, batch_rows: int) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.json as pjson

    row = 0
    block_bytes = max(1 << 16, min(batch_rows * 200, 1 << 26))  # memory is bounded by blocks: no longer line
    failed = None
    # The reader parses ahead on Arrow's threads: closed here, whatever ends the read, rather than when the
    # exception that holds this frame is collected, which at interpreter exit can abort the process.
    options = pjson.ReadOptions(block_size=block_bytes)
    with open_uri(f.uri) as source:
        try:
            with contextlib.closing(pjson.open_json(source, read_options=options)) as reader:
                for batch in reader:
                    yield Batch(batch, [f.uri], row, position_keys(f.relpath, row, batch.num_rows))
                    row += batch.num_rows
        except pa.ArrowInvalid as exc:
            failed = exc
    if failed is not None:
        long = _long_line(f.uri, block_bytes, first_row=row) if "straddl" in str(failed) else None
        if long is not None:
            raise DataError(f"{f.uri}: row {long} is a line longer than the {block_bytes:,}-byte blocks JSON Lines "
                            f"are read in (data.batch_rows x 200 bytes, at most 64 MiB); expected one JSON object "
                            f"of fewer bytes per line") from None
        # Arrow's message names the JSON column and the row where a value changed type.
        raise DataError(f"{f.uri}: not readable as JSON Lines after row {row} ({failed}); each line must be "
                        f"one JSON object and a column keeps one type") from failed


def _long_line(uri: str, limit: int, first_row: int) -> int | None:
    """The first row from ``first_row`` on whose line is at least ``limit`` bytes long, the file read a
    bounded piece at a time."""
    with open_uri(uri) as fh:
        row, length = 0, 0
        for block in iter(lambda: fh.read(1 << 20), b""):
            at = 0
            while (end := block.find(b"\n", at)) >= 0:
                if row >= first_row and length + end - at >= limit:
                    return row
                row, length, at = row + 1, 0, end + 1
            length += len(block) - at
            if row >= first_row and length >= limit:
                return row
    return None


def _read_images(unit: Unit, batch_rows: int) -> Iterator[Batch]:
    import pyarrow as pa

    for start in range(0, len(unit.files), batch_rows):
        chunk = unit.files[start:start + batch_rows]
        blobs = []
        for f in chunk:
            with open_uri(f.uri, None) as fh:
                blobs.append(fh.read())
        labels = [PurePosixPath(f.relpath).parts[-2] for f in chunk]
        table = pa.record_batch({"image": pa.array(blobs, pa.binary()), "label": pa.array(labels, pa.string())})
        # An image's split follows its own path: adding images never moves the others.
        yield Batch(table, [f.uri for f in chunk], -1, key_hashes([f.relpath for f in chunk]))
