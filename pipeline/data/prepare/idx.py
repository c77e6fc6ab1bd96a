"""IDX files (MNIST, FashionMNIST): an images file and a labels file, read by row ranges, headers checked.

An IDX file is a magic number (0x0803 images, 0x0801 labels, unsigned bytes), one uint32 size per
dimension, then the items back to back. A header is checked against the file's length before any work
is planned from it: a header claiming more items than the file holds would otherwise plan work for
rows that do not exist.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from pipeline.data import open_uri
from pipeline.data.prepare.plan import Batch, SourceFile, Unit, position_keys
from pipeline.errors import DataError

IMAGES, LABELS = 0x803, 0x801


def read(uri: str, expected_magic: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows ``[start, stop)`` of an IDX file (images [n, rows, cols] or labels [n]), the header checked.

    A plain file is read at the rows' offset; a gzipped one is decompressed up to them, which is why
    ``stage`` decompresses gzipped files once before workers share them out.
    """
    with open_uri(uri) as fh:
        dims = header(fh, uri, expected_magic)
        item = int(np.prod(dims[1:]))
        stop = dims[0] if stop is None else min(stop, dims[0])
        fh.seek(4 + 4 * len(dims) + start * item)
        want = (stop - start) * item
        data = fh.read(want)
    if len(data) != want:
        raise DataError(f"{uri}: header says {dims}, the data ends inside row {start + len(data) // max(item, 1)}; "
                        f"the file is truncated or not IDX")
    return np.frombuffer(data, dtype=np.uint8).reshape((stop - start, *dims[1:]))


def header(fh, uri: str, expected_magic: int) -> list[int]:
    head = fh.read(4)
    magic = int.from_bytes(head, "big") if len(head) == 4 else None
    if magic != expected_magic:
        shown = f"{magic:#010x}" if magic is not None else "missing"
        raise DataError(f"{uri}: IDX magic number {shown}; expected {expected_magic:#010x} "
                        f"({'images' if expected_magic == IMAGES else 'labels'}, unsigned bytes)")
    ndim = head[3]
    raw = fh.read(4 * ndim)
    if len(raw) != 4 * ndim:
        raise DataError(f"{uri}: the IDX header is cut short; the file is truncated or not IDX")
    return [int.from_bytes(raw[4 * i: 4 * i + 4], "big") for i in range(ndim)]


def count(f: SourceFile) -> tuple[int, int]:
    """Images in an IDX pair, and bytes per image and label; each header checked against its file's length."""
    with open_uri(f.uri) as fh:
        dims = header(fh, f.uri, IMAGES)
        _check_length(fh, f.uri, dims)
    with open_uri(f.partner) as fh:
        labels = header(fh, f.partner, LABELS)
        _check_length(fh, f.partner, labels)
    if labels[0] != dims[0]:
        raise DataError(f"{f.partner}: {labels[0]} labels for {dims[0]} images in {f.uri}; expected one label per image")
    return dims[0], int(np.prod(dims[1:])) + 1


def _check_length(fh, uri: str, dims: list[int]) -> None:
    """The file (read past its header) holds the items its header claims."""
    start, item = fh.tell(), int(np.prod(dims[1:]))
    try:
        size = fh.seek(0, os.SEEK_END)
    except (OSError, ValueError, io.UnsupportedOperation):  # gzip streams seek forward only: count the bytes
        size = start + sum(len(block) for block in iter(lambda: fh.read(1 << 20), b""))
    held = (size - start) // item if item else dims[0]
    if held < dims[0]:
        raise DataError(f"{uri}: the IDX header says {dims[0]} items of shape {tuple(dims[1:])}, the data ends "
                        f"inside row {held}; the file is truncated or its header is wrong")


def stage(units: list[Unit], folder: Path) -> list[Unit]:
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
                with open_uri(uri) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                copies[uri] = str(target)
        return copies[uri]

    return [Unit(u.index, tuple(SourceFile(f.uri, f.relpath, f.size, f.partner, (local(f.uri), local(f.partner)))
                                for f in u.files), u.start, u.stop, u.size_bytes) for u in units]


def read_unit(unit: Unit, batch_rows: int) -> Iterator[Batch]:
    import pyarrow as pa

    f = unit.files[0]
    images_at, labels_at = f.staged or (f.uri, f.partner)
    for start in range(unit.start, unit.stop, batch_rows):
        stop = min(start + batch_rows, unit.stop)
        images = read(images_at, IMAGES, start, stop)
        labels = read(labels_at, LABELS, start, stop)
        shape = images.shape[1:]
        flat = pa.FixedSizeListArray.from_arrays(pa.array(images.reshape(-1)), int(np.prod(shape)))
        table = pa.record_batch({
            "image": pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.uint8(), shape), flat),
            "label": pa.array(labels.astype(np.int64)),
        })
        yield Batch(table, [f.uri], start, position_keys(f.relpath, start, stop - start))


