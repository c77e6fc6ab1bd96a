"""A corpus of bad inputs: each fails with the error that says what and where, or is quarantined and
counted; nothing is ever published where readers look."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from pipeline.data.demo import write_idx
from pipeline.data.prepare.version import prepare
from pipeline.data.versions.manifest import read_preprocessing
from pipeline.errors import ConfigError, DataError, UserError
from tests.datafiles import (
    cfg,
    dataset_dir,
    eight_bad_rows,
    published,
    table,
    write_image_folder,
    write_parquet,
)


def _parquet(t: pa.Table):
    return lambda d: write_parquet(d / "bad.parquet", t)


def _with(column: str, values) -> pa.Table:
    t = table()
    return t.set_column(t.schema.get_field_index(column), column, pa.array(values))


def _two_files(d):
    write_parquet(d / "in" / "part-0.parquet", table(300))
    write_parquet(d / "in" / "part-1.parquet", table(300, seed=1).drop_columns(["b"]))
    return d / "in"


def _second_file_of_another_type(d):
    write_parquet(d / "in" / "part-0.parquet", table(300))
    other = table(300, seed=1)
    other = other.set_column(1, "b", pa.array([[1, 2]] * 300))
    write_parquet(d / "in" / "part-1.parquet", other)
    return d / "in"


def _csv_with_text_in_a_number(d):
    t = table(300)
    pcsv.write_csv(t, d / "bad.csv")
    lines = (d / "bad.csv").read_text().splitlines()
    fields = lines[201].split(",")
    fields[0] = '"abc"'
    lines[201] = ",".join(fields)
    (d / "bad.csv").write_text("\n".join(lines) + "\n")
    return d / "bad.csv"


def _jsonl_changing_type(d):
    rows = table(50).to_pylist()
    rows[30]["a"] = "not a number"
    (d / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d / "bad.jsonl"


def _corrupt_image(d):
    write_image_folder(d / "img", {"boot": 30, "shirt": 30})
    (d / "img" / "shirt" / "007.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    return d / "img"


def _idx_label_count(d):
    rng = np.random.default_rng(0)
    write_idx(d / "idx", "train", rng.integers(0, 255, (50, 28, 28)), rng.integers(0, 10, 49))
    return d / "idx"


def _idx_truncated(d):
    rng = np.random.default_rng(0)
    write_idx(d / "idx", "train", rng.integers(0, 255, (50, 28, 28)), rng.integers(0, 10, 50), gz=False)
    path = d / "idx" / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    return d / "idx"


def _idx_wrong_magic(d):
    rng = np.random.default_rng(0)
    write_idx(d / "idx", "train", rng.integers(0, 255, (50, 28, 28)), rng.integers(0, 10, 50))
    (d / "idx" / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x08\x03" + bytes(60)))
    return d / "idx"


def _numbers_as_text(rows: int = 200, bad_row: int = 150, token: str = "n/a") -> pa.Table:
    """A numeric feature stored as text because of one stray token, as a CSV export or a pandas frame
    with one unparsed value writes it."""
    t = table(rows)
    text = [f"{v:.6f}" for v in t.column("a").to_pylist()]
    text[bad_row] = token
    return t.set_column(0, "a", pa.array(text))


def _csv_of(t: pa.Table):
    def make(d):
        pcsv.write_csv(t, d / "bad.csv")
        return d / "bad.csv"
    return make


def _identifiers() -> pa.Table:
    return table().append_column("user", pa.array([f"u-{i:05d}" for i in range(600)]))


def _empty_folder(d):
    (d / "empty").mkdir()
    (d / "empty" / "notes.txt").write_text("no data here")
    return d / "empty"


CORPUS = [
    ("missing-file", lambda d: d / "nope.parquet", {}, DataError, "does not exist"),
    ("empty-folder", _empty_folder, {}, DataError, "found no input files"),
    ("no-rows", _parquet(table().slice(0, 0)), {}, DataError, "the input has no rows"),
    ("missing-label", _parquet(table().drop_columns(["label"])), {}, DataError,
     "data.label_column 'label' is not a column; the columns are ['a', 'b', 'color']"),
    ("unexpected-column", _parquet(table().append_column("extra", pa.array(np.zeros(600)))),
     {"columns": ["a", "b", "color", "label"]}, DataError, "unexpected column(s) ['extra']; expected the columns"),
    ("missing-column-in-second-file", _two_files, {}, DataError, "part-1.parquet: missing column(s) ['b']"),
    ("column-type-changes-between-files", _second_file_of_another_type, {}, DataError,
     "part-1.parquet: column 'b' has type list<element: int64>, which does not convert to the column's encoding 'int64'"),
    ("timestamp-feature", _parquet(table().append_column("ts", pa.array(np.arange(600).astype("datetime64[s]")))), {},
     DataError, "feature column 'ts' has type timestamp[ms]; features must be numeric"),
    ("nan-feature", _parquet(_with("a", [1.0] * 599 + [float("nan")])), {}, DataError,
     "bad.parquet: row 599, column 'a': value nan; expected a finite number"),
    ("inf-feature", _parquet(_with("a", [1.0] * 17 + [float("inf")] + [1.0] * 582)), {}, DataError,
     "row 17, column 'a': value inf; expected a finite number"),
    ("null-feature", _parquet(_with("b", [1] * 42 + [None] + [1] * 557)), {}, DataError,
     "row 42, column 'b': value is null; expected a finite number"),
    ("text-in-a-number-csv", _csv_with_text_in_a_number, {}, DataError, "bad.csv: row 200, column 'a': value 'abc'; expected a number"),
    ("numbers-as-text-parquet", _parquet(_numbers_as_text()), {}, DataError,
     "bad.parquet: row 150, column 'a': value 'n/a'; expected a number: 199 of the column's first 200 values are numbers"),
    ("numbers-as-text-csv", _csv_of(_numbers_as_text(token="?")), {}, DataError,
     "bad.csv: row 150, column 'a': value '?'; expected a number"),
    ("identifiers-as-text", _parquet(_identifiers()), {}, DataError,
     "bad.parquet: row 0, column 'user': value 'u-00000' is one of 600 distinct values in the column's first 600 values"),
    ("jsonl-type-change", _jsonl_changing_type, {}, DataError, "bad.jsonl: not readable as JSON Lines"),
    ("float-label", _parquet(_with("label", [1.5] * 600)), {}, DataError, "label column 'label' has type double"),
    ("label-outside-classes", _parquet(_with("label", ["cat", "dog"] * 299 + ["bird", "cat"])),
     {"label_classes": ["cat", "dog"]}, DataError, "row 598, column 'label': label 'bird'; expected one of ['cat', 'dog']"),
    ("null-label", _parquet(_with("label", ["cat", "dog"] * 100 + [None] + ["cat"] * 399)), {}, DataError,
     "row 200, column 'label': label is null"),
    ("one-class", _parquet(_with("label", ["x"] * 600)), {}, DataError, "expected at least 2 classes"),
    ("undecodable-image", _corrupt_image, {}, DataError, "shirt/007.png, column 'image': value of 48 bytes is not a decodable image"),
    ("idx-label-count", _idx_label_count, {}, DataError, "49 labels for 50 images"),
    ("idx-truncated", _idx_truncated, {}, DataError, "the data ends inside row 49; the file is truncated"),
    ("idx-wrong-magic", _idx_wrong_magic, {}, DataError, "IDX magic number 0x00000803; expected 0x00000801"),
    ("pickle-encoding", _parquet(table()), {"column_encodings": ["a:pkl"]}, ConfigError, "pickle columns are refused"),
    ("unknown-encoding", _parquet(table()), {"column_encodings": ["a:float128"]}, ConfigError,
     "encoding 'float128' is not supported"),
]


@pytest.mark.parametrize("make, overrides, error, expected", [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_bad_input_fails_with_a_clear_error_and_nothing_is_published(tmp_path, make, overrides, error, expected):
    path = make(tmp_path)
    with pytest.raises(error) as raised:
        prepare(cfg(path, **overrides), name="t", out_root=tmp_path / "out")
    assert isinstance(raised.value, UserError)  # fails the task at once, no retry
    assert expected in str(raised.value)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").rglob("*")) in ([], [tmp_path / "out" / "t"])


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_a_number_column_stored_as_text_fails_until_it_is_declared(tmp_path, fmt):
    t = _numbers_as_text(token="-")
    path = tmp_path / f"in.{fmt}"
    write_parquet(path, t) if fmt == "parquet" else pcsv.write_csv(t, path)
    with pytest.raises(DataError) as raised:
        prepare(cfg(path), name="t", out_root=tmp_path / "out")
    message = str(raised.value)
    assert message.startswith(f"{path}: row 150, column 'a': value '-'; expected a number")
    assert "data.column_encodings ['a:float64']" in message and "data.categorical_columns ['a']" in message
    assert published(tmp_path / "out") == []

    # Declared numeric: the stray value is one bad row, quarantined here.
    numeric = prepare(cfg(path, column_encodings=["a:float64"], on_bad_rows="quarantine"), name="n",
                           out_root=tmp_path / "out")
    assert numeric["schema"]["numeric_columns"] == ["a", "b"] and numeric["bad_rows"]["count"] == 1
    (row,) = pq.read_table(dataset_dir(numeric) / "quarantine.parquet").to_pylist()
    assert row["a"] == "-" and row["_source"].endswith("row 150")
    # Declared categorical: accepted as text, a category per value.
    categorical = prepare(cfg(path, categorical_columns=["a"]), name="c", out_root=tmp_path / "out")
    assert categorical["schema"]["categorical_columns"] == ["a", "color"]
    assert len(read_preprocessing(dataset_dir(categorical))["vocab"]["a"]) > 100


def test_a_text_column_with_a_value_per_row_fails_unless_declared(tmp_path):
    write_parquet(tmp_path / "in.parquet", _identifiers())
    with pytest.raises(DataError, match=r"'u-00000' is one of 600 distinct values.*data.categorical_columns \['user'\]"
                                        r"; or, if it identifies rows, name it data.key_column"):
        prepare(cfg(tmp_path / "in.parquet"), name="t", out_root=tmp_path / "out")
    as_key = prepare(cfg(tmp_path / "in.parquet", key_column="user"), name="k", out_root=tmp_path / "out")
    assert as_key["schema"]["categorical_columns"] == ["color"]
    declared = prepare(cfg(tmp_path / "in.parquet", categorical_columns=["user"]), name="c", out_root=tmp_path / "out")
    assert declared["schema"]["categorical_columns"] == ["color", "user"]


def test_text_categories_that_repeat_are_categorical(tmp_path):
    # 300 categories over 600 rows: half as many as rows, well below a value per row.
    t = table().append_column("city", pa.array([f"city-{i % 300}" for i in range(600)]))
    write_parquet(tmp_path / "in.parquet", t)
    manifest = prepare(cfg(tmp_path / "in.parquet"), name="t", out_root=tmp_path / "out")
    assert manifest["schema"]["categorical_columns"] == ["color", "city"]


def test_quarantine_fails_the_run_above_the_bad_fraction(tmp_path):
    write_parquet(tmp_path / "in.parquet", eight_bad_rows())
    with pytest.raises(DataError, match=r"8 of 600 rows \(1.33%\) are bad, more than data.max_bad_fraction=0.01"):
        prepare(cfg(tmp_path / "in.parquet", on_bad_rows="quarantine", max_bad_fraction=0.01,
                         label_classes=["cat", "dog"]), name="t", out_root=tmp_path / "out")
    assert published(tmp_path / "out") == []
    assert list((tmp_path / "out" / "t").iterdir()) == []


def test_quarantine_of_an_undecodable_image(tmp_path):
    path = _corrupt_image(tmp_path)
    manifest = prepare(cfg(path, on_bad_rows="quarantine", max_bad_fraction=0.05), name="t", out_root=tmp_path / "out")
    assert manifest["bad_rows"]["count"] == 1 and sum(manifest["splits"].values()) == 59
    (row,) = pq.read_table(dataset_dir(manifest) / "quarantine.parquet").to_pylist()
    assert row["_source"].endswith("shirt/007.png") and row["label"] == "shirt" and len(row["image"]) == 48


def test_quarantine_of_text_in_a_csv_number(tmp_path):
    path = _csv_with_text_in_a_number(tmp_path)
    manifest = prepare(cfg(path, on_bad_rows="quarantine", column_encodings=["a:float64"]), name="t",
                            out_root=tmp_path / "out")
    assert manifest["bad_rows"]["count"] == 1 and sum(manifest["splits"].values()) == 299
    (row,) = pq.read_table(dataset_dir(manifest) / "quarantine.parquet").to_pylist()
    assert row["a"] == "abc" and row["_error"] == "value 'abc'; expected a number"
