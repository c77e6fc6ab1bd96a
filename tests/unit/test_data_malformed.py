"""Malformed inputs, bounded: damaged files of every source format fail with an error naming file and row,
in a child process whose memory stays under a limit, and nothing is published. (That each ends at all is
guarded by ``tests.bounded.HANG_GUARD_S``; how long each takes belongs in bench/, not here.)

The rest of the bad-input corpus, with values rather than files at fault, is in test_data_validation.py."""

import gzip
import json
import re

import numpy as np
import pyarrow.csv as pcsv
import pytest

from pipeline.data.demo import write_idx
from tests.bounded import run_prepare
from tests.datafiles import (
    png_bad_filter,
    png_bomb,
    published,
    table,
    write_image_folder,
    write_parquet,
)

MEMORY_LIMIT_BYTES = 256 << 20  # a 200 MB line or a 30000 x 30000 image held whole would pass it


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, low = n >> 7, n & 0x7F
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _parquet_truncated(d):
    path = write_parquet(d / "bad.parquet", table(600))
    path.write_bytes(path.read_bytes()[:-300])  # a copy cut short: the footer is gone
    return path


def _parquet_footer_lies(d):
    """The footer's row counts (file, row group, column chunks) say 8000 where the pages hold 600 rows."""
    path = write_parquet(d / "bad.parquet", table(600), row_group_size=600)
    data = path.read_bytes()
    footer_start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    footer = bytearray(data[footer_start:-8])
    said, lie = _varint(600 * 2), _varint(8000 * 2)  # thrift's zigzag varints, both 2 bytes long
    at = footer.find(said)
    while at >= 0:
        if at and footer[at - 1] & 0x0F == 6:  # the field before it is an i64: a count, not an offset's tail
            footer[at:at + 2] = lie
        at = footer.find(said, at + 1)
    path.write_bytes(data[:footer_start] + bytes(footer) + data[-8:])
    return path


def _csv_rows(d, changes: dict):
    """A CSV of ``table(300)`` with rows changed: ``{row: line -> line}``."""
    pcsv.write_csv(table(300), d / "bad.csv")
    lines = (d / "bad.csv").read_bytes().split(b"\n")
    for row, change in changes.items():
        lines[row + 1] = change(lines[row + 1])  # line 0 is the header
    (d / "bad.csv").write_bytes(b"\n".join(lines))
    return d / "bad.csv"


def _color(value: bytes):
    """Row -> the same row with ``value`` as its color (the third field)."""
    return lambda line: b",".join([*line.split(b",")[:2], value, *line.split(b",")[3:]])


def _csv_nul(d):
    return _csv_rows(d, {40: _color(b""), 100: _color(b'"r\x00ed"')})  # an empty (null) value before it


def _csv_mixed_encodings(d):
    """A UTF-8 file with one row appended by a tool that wrote Latin-1."""
    return _csv_rows(d, {40: _color(b""), 150: _color('"rouge é"'.encode("latin-1"))})


def _jsonl_200mb_line(d):
    rows = table(50).to_pylist()
    with open(d / "bad.jsonl", "w") as f:
        for i, row in enumerate(rows):
            if i == 20:  # {"a": ..., "color": "xxxx...(200 MB)..."}
                f.write(json.dumps({**row, "color": ""})[:-2] + '"')
                for _ in range(200):
                    f.write("x" * (1 << 20))
                f.write('"}\n')
            else:
                f.write(json.dumps(row) + "\n")
    return d / "bad.jsonl"


def _idx_header_claims_more(d):
    rng = np.random.default_rng(0)
    write_idx(d / "idx", "train", rng.integers(0, 255, (50, 28, 28)), rng.integers(0, 10, 50))
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"):
        raw = bytearray(gzip.decompress((d / "idx" / name).read_bytes()))
        raw[4:8] = (10**9).to_bytes(4, "big")  # a billion items, in files that hold 50
        (d / "idx" / name).write_bytes(gzip.compress(bytes(raw)))
    return d / "idx"


def _image(blob_of):
    def make(d):
        write_image_folder(d / "img", {"boot": 30, "shirt": 30})
        path = d / "img" / "shirt" / "007.png"
        path.write_bytes(blob_of(path.read_bytes()))
        return d / "img"
    return make


CASES = [
    ("parquet-truncated", _parquet_truncated, {}, r"bad.parquet: not a readable Parquet file \(Parquet magic bytes"),
    ("parquet-footer-lies", _parquet_footer_lies, {},
     r"bad.parquet: row group\(s\) 0-0 hold 600 rows from row 0, the file's footer says 8000; the file is damaged"),
    ("csv-nul-bytes", _csv_nul, {}, r"bad.csv: row 100, column 'color': value 'r\\x00ed' holds a NUL byte; expected text"),
    ("csv-mixed-encodings", _csv_mixed_encodings, {},
     r"bad.csv: row 150, column 'color': value b'rouge \\xe9' is not UTF-8 text; expected a UTF-8 file"),
    # Read in blocks of batch_rows x 200 bytes; Arrow holds several at once, so a small block shows that memory
    # follows the block, not the line.
    ("jsonl-200mb-line", _jsonl_200mb_line, {"batch_rows": 8192},
     r"bad.jsonl: row 20 is a line longer than the 1,638,400-byte blocks JSON Lines are read in"),
    ("idx-header-claims-more", _idx_header_claims_more, {},
     r"train-images-idx3-ubyte.gz: the IDX header says 1000000000 items of shape \(28, 28\), the data ends inside "
     r"row 50"),
    ("image-zero-bytes", _image(lambda blob: b""), {}, r"shirt/007.png, column 'image': value of 0 bytes is empty"),
    ("image-truncated", _image(lambda blob: blob[:len(blob) // 2]), {},
     r"shirt/007.png, column 'image': value of \d+ bytes is not a decodable image \(OSError: image file is truncated"),
    ("image-garbage", _image(lambda blob: bytes(np.random.default_rng(1).integers(0, 256, 500, dtype=np.uint8))), {},
     r"shirt/007.png, column 'image': value of 500 bytes is not a decodable image \(UnidentifiedImageError"),
    ("image-bad-filter-bytes", _image(lambda blob: png_bad_filter()), {},
     r"shirt/007.png, column 'image': value of 99 bytes is not a decodable image"),
    ("image-decompression-bomb", _image(lambda blob: png_bomb()), {},
     r"shirt/007.png, column 'image': value of 109 bytes is a decompression bomb \(Image size \(900000000 pixels\)"),
]


@pytest.mark.parametrize("make, overrides, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_malformed_file_fails_naming_file_and_row_in_bounded_memory(tmp_path, make, overrides, expected):
    path = make(tmp_path)
    result = run_prepare(path, tmp_path / "out", **overrides)
    assert result["type"] == "DataError", result  # a user error: the task fails at once, without retries
    assert re.search(expected, result["message"]), result["message"]
    print(f"peak memory growth {result['peak_growth_bytes'] / 2**20:.0f} MiB")
    assert result["peak_growth_bytes"] < MEMORY_LIMIT_BYTES, result
    assert published(tmp_path / "out") == []
    assert not list((tmp_path / "out").glob("*/.tmp-*"))  # no half-written version either
