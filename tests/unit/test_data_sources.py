"""Every source format to MDS and back through StreamingDataset: values, types and labels survive."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from pipeline.data import local_path
from pipeline.data.demo import write_idx
from pipeline.data.prepare import mds_writer
from pipeline.data.prepare.version import prepare
from pipeline.data.read.training_data import TrainingData
from pipeline.errors import ConfigError, DataError
from tests.datafiles import (
    cfg,
    image_bytes,
    read_rows,
    table,
    write_image_folder,
    write_parquet,
)


def test_hive_partitioned_parquet_and_a_data_interval_selects_partitions(tmp_path):
    days = ["2026-11-27", "2026-11-28", "2026-11-29"]
    for i, day in enumerate(days):
        t = table(300, seed=i).append_column("id", pa.array(np.arange(300) + 1000 * i))
        write_parquet(tmp_path / "in" / f"dt={day}" / "part-0.parquet", t)
    whole = prepare(cfg(tmp_path / "in"), name="t", out_root=tmp_path / "out")
    assert sum(whole["splits"].values()) == 900
    assert [s["relpath"] for s in whole["sources"]] == [f"dt={d}/part-0.parquet" for d in days]

    day = prepare(cfg(tmp_path / "in"), name="t", out_root=tmp_path / "out",
                       interval=("2026-11-28T00:00:00+00:00", "2026-11-29T00:00:00+00:00"))
    assert [s["relpath"] for s in day["sources"]] == ["dt=2026-11-28/part-0.parquet"]
    ids = sorted(int(r["id"]) for r in read_rows(day, tmp_path / "cache"))
    assert ids == list(range(1000, 1300))
    assert day["interval"] == {"start": "2026-11-28T00:00:00+00:00", "end": "2026-11-29T00:00:00+00:00"}


def test_csv_values_types_and_labels_round_trip(tmp_path):
    t = table(500)
    path = tmp_path / "in.csv"
    pcsv.write_csv(t, path)
    manifest = prepare(cfg(path), name="t", out_root=tmp_path / "out")
    assert manifest["schema"]["fmt"] == "csv"
    assert manifest["schema"]["encodings"] == {"a": "float64", "b": "int64", "color": "str", "label": "str"}
    got = sorted((round(r["a"], 9), int(r["b"]), r["color"], r["label"]) for r in read_rows(manifest, tmp_path / "c"))
    want = sorted((round(a, 9), b, c, y) for a, b, c, y in zip(*(t.column(n).to_pylist() for n in ("a", "b", "color", "label"))))
    assert got == want


def test_json_lines_round_trip(tmp_path):
    t = table(300)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in t.to_pylist()))
    manifest = prepare(cfg(path), name="t", out_root=tmp_path / "out")
    assert manifest["schema"]["fmt"] == "jsonl"
    got = sorted((r["a"], int(r["b"]), r["color"], r["label"]) for r in read_rows(manifest, tmp_path / "c"))
    assert got == sorted(zip(*(t.column(n).to_pylist() for n in ("a", "b", "color", "label"))))


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "raw"])
def test_idx_files_become_28x28_arrays_with_int_labels(tmp_path, gz):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (700, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 700)
    write_idx(tmp_path / "fashion", "train", images[:500], labels[:500], gz=gz)
    write_idx(tmp_path / "fashion", "t10k", images[500:], labels[500:], gz=gz)
    manifest = prepare(cfg(tmp_path / "fashion", unit_bytes=128 * 785, shard_size_limit_bytes=1 << 15),
                            name="t", out_root=tmp_path / "out")
    assert manifest["schema"]["fmt"] == "idx"
    assert manifest["schema"]["encodings"] == {"image": "ndarray:uint8:28,28", "label": "int64"}
    assert manifest["label_classes"] == sorted(set(labels.tolist()))
    rows = read_rows(manifest, tmp_path / "c")
    assert len(rows) == 700
    # Every image comes back exactly, with its own label (pair them by pixels: images are unique).
    want = {images[i].tobytes(): int(labels[i]) for i in range(700)}
    assert {r["image"].tobytes(): int(r["label"]) for r in rows} == want
    assert all(r["image"].shape == (28, 28) and r["image"].dtype == np.uint8 for r in rows)


def test_idx_images_can_be_stored_as_png(tmp_path):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (60, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / "mnist", "train", images, rng.integers(0, 3, 60))
    manifest = prepare(cfg(tmp_path / "mnist", column_encodings=["image:png"]), name="t", out_root=tmp_path / "out")
    assert manifest["schema"]["encodings"]["image"] == "png"
    decoded = {np.asarray(r["image"]).tobytes() for r in read_rows(manifest, tmp_path / "c")}
    assert decoded == {img.tobytes() for img in images}


def test_image_folders_png_and_jpeg_with_class_labels(tmp_path):
    written = write_image_folder(tmp_path / "png", {"boot": 30, "shirt": 25})
    manifest = prepare(cfg(tmp_path / "png"), name="png", out_root=tmp_path / "out")
    assert manifest["schema"]["fmt"] == "image_folder"
    assert manifest["schema"]["encodings"] == {"image": "png", "label": "str"}
    assert manifest["label_classes"] == ["boot", "shirt"]
    rows = read_rows(manifest, tmp_path / "c")
    by_pixels = {np.asarray(r["image"]).tobytes(): r["label"] for r in rows}
    assert by_pixels == {pixels.tobytes(): name.split("/")[0] for name, pixels in written.items()}

    write_image_folder(tmp_path / "jpg", {"boot": 12, "shirt": 12}, fmt="JPEG")
    jpeg = prepare(cfg(tmp_path / "jpg"), name="jpg", out_root=tmp_path / "out")
    assert jpeg["schema"]["encodings"]["image"] == "jpeg"
    assert {r["label"] for r in read_rows(jpeg, tmp_path / "c2")} == {"boot", "shirt"}
    assert all(np.asarray(r["image"]).shape == (8, 8) for r in read_rows(jpeg, tmp_path / "c3"))


def test_a_folder_mixing_png_and_jpeg_is_stored_in_one_encoding(tmp_path):
    write_image_folder(tmp_path / "in", {"a": 20, "b": 20}, fmt="PNG")
    (tmp_path / "in" / "b" / "zz.jpg").write_bytes(image_bytes(np.full((8, 8), 7, np.uint8), "JPEG"))
    manifest = prepare(cfg(tmp_path / "in"), name="t", out_root=tmp_path / "out")
    rows = read_rows(manifest, tmp_path / "c")
    assert len(rows) == 41
    assert {r["image"].format for r in rows} == {"PNG"}  # the JPEG was re-encoded, not mislabelled


def test_file_uri_and_an_fsspec_store(tmp_path):
    import fsspec

    t = table(300)
    write_parquet(tmp_path / "in.parquet", t)
    by_uri = prepare(cfg((tmp_path / "in.parquet").as_uri()), name="uri", out_root=tmp_path / "out")
    assert sum(by_uri["splits"].values()) == 300

    # An object store as fsspec sees it (in-memory here; s3:// and gs:// go through the same calls).
    fs = fsspec.filesystem("memory")
    with fs.open("/bucket/raw/part-0.parquet", "wb") as fh:
        pq.write_table(t, fh, row_group_size=100)
    remote = prepare(cfg("memory://bucket/raw"), name="mem", out_root=tmp_path / "out")
    assert remote["sources"][0]["path"] == "memory:///bucket/raw/part-0.parquet"
    assert remote["sources"][0]["sha256"] == by_uri["sources"][0]["sha256"]  # the same bytes
    assert sum(remote["splits"].values()) == 300


@pytest.mark.parametrize("uri, path", [
    ("file:///data/my%20runs%25/v1", "/data/my runs%/v1"),
    ("file://localhost/data/my%20runs%25/v1", "/data/my runs%/v1"),
    ("file:/data/a%20b", "/data/a b"),
    ("/data/my runs%20/v1", "/data/my runs%20/v1"),  # a plain path is taken as it is
])
def test_local_path_decodes_file_uris(uri, path):
    assert local_path(uri) == Path(path)


def test_local_path_refuses_another_hosts_file_uri():
    with pytest.raises(DataError, match="a file URI of host 'nas'"):
        local_path("file://nas/data/v1")


def test_a_home_with_a_space_and_a_percent_sign(tmp_path):
    home = tmp_path / "pipeline home 100%"
    write_parquet(home / "raw" / "in.parquet", table(300))
    manifest = prepare(cfg((home / "raw" / "in.parquet").as_uri()), name="t", out_root=home / "data")
    assert "%20" in manifest["uri"] and "%25" in manifest["uri"]  # a URI, percent-encoded
    assert local_path(manifest["uri"]) == home / "data" / "t" / manifest["version"]
    data = TrainingData.open([manifest["uri"]], home / "cache")
    frame, labels = data.frame("train")
    assert len(frame) == len(labels) == manifest["splits"]["train"]


def test_batch_encoding_is_byte_identical_to_mdswriter():
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    tensor = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.uint8(), (2, 3)),
                                            pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 255, 30, dtype=np.uint8)), 6))
    t = pa.table({"f": rng.normal(size=5), "i": rng.integers(-5, 5, 5), "s": ["", "ab", "héllo", "x", "yz"],
                  "u": pa.array([1, 0, 1, 1, 0], pa.uint8()), "img": tensor,
                  "blob": pa.array([b"\x89PNG\r\n\x1a\n", b"", b"abc", b"d", b"ef"], pa.binary())})
    columns = {"f": "float64", "i": "int64", "s": "str", "u": "uint8", "img": "ndarray:uint8:2,3", "blob": "bytes"}
    sliced = t.slice(1)  # an offset into the Arrow buffers, as filtered batches have
    buf, bounds = mds_writer.encode_batch(columns, sliced)
    writer = MDSWriter(out="/tmp/unused-mds-writer", columns=columns, exist_ok=True)
    for i, row in enumerate(sliced.to_pylist()):
        row["img"] = np.asarray(row["img"], dtype=np.uint8).reshape(2, 3)
        assert writer.encode_sample(row) == buf[bounds[i]:bounds[i + 1]].tobytes()


def test_encodings_can_be_overridden_and_pickle_is_refused(tmp_path):
    write_parquet(tmp_path / "in.parquet", table(300))
    manifest = prepare(cfg(tmp_path / "in.parquet", column_encodings=["a:float32", "b:int32"]), name="t",
                            out_root=tmp_path / "out")
    assert manifest["schema"]["encodings"]["a"] == "float32" and manifest["schema"]["encodings"]["b"] == "int32"
    rows = read_rows(manifest, tmp_path / "c")
    assert {type(r["a"]) for r in rows} == {np.float32}
    with pytest.raises(ConfigError, match="pickle columns are refused"):
        prepare(cfg(tmp_path / "in.parquet", column_encodings=["a:pkl"]), name="t", out_root=tmp_path / "out")
    with pytest.raises(ConfigError, match=r"column 'label' cannot be stored as 'float32'; expected one of \['str'\]"):
        prepare(cfg(tmp_path / "in.parquet", column_encodings=["label:float32"]), name="t", out_root=tmp_path / "out")
    # Declaring a text column numeric parses its values; one that is not a number is a bad row.
    with pytest.raises(DataError, match="row 0, column 'color': value 'green'; expected a number"):
        prepare(cfg(tmp_path / "in.parquet", column_encodings=["color:float32"]), name="t", out_root=tmp_path / "out")
    assert [p.name for p in (tmp_path / "out" / "t").iterdir()] == [manifest["version"]]


@pytest.mark.parametrize("compression", ["zstd", None])
def test_part_writer_files_are_byte_identical_to_mdswriter(tmp_path, compression):
    from streaming import MDSWriter

    t = table(700)
    columns = {"a": "float64", "b": "int64", "color": "str", "label": "str"}
    buf, bounds = mds_writer.encode_batch(columns, t)
    ours = mds_writer.PartWriter(tmp_path / "ours", columns, compression=compression, size_limit=1 << 12)
    for start, stop in ((0, 300), (300, 301), (301, 700)):  # several writes, as the workers do
        ours.write(buf, bounds, start, stop)
    ours.finish()
    with MDSWriter(out=str(tmp_path / "theirs"), columns=columns, compression=compression,
                   hashes=mds_writer.HASHES, size_limit=1 << 12) as theirs:
        for row in t.to_pylist():
            theirs.write(row)
    files = sorted(p.name for p in (tmp_path / "theirs").iterdir())
    assert len(files) > 5 and files == sorted(p.name for p in (tmp_path / "ours").iterdir())
    for name in files:
        ours_bytes, theirs_bytes = ((tmp_path / d / name).read_bytes() for d in ("ours", "theirs"))
        if name == "index.json":
            assert json.loads(ours_bytes) == json.loads(theirs_bytes)
        else:
            assert ours_bytes == theirs_bytes, name


def test_csv_booleans_and_text_categories_that_look_numeric(tmp_path):
    (tmp_path / "in.csv").write_text("flag,zip,label\n" + "".join(
        f"{'true' if i % 3 else 'false'},{10000 + i % 7},{i % 2}\n" for i in range(300)))
    manifest = prepare(cfg(tmp_path / "in.csv", categorical_columns=["zip"]), name="t", out_root=tmp_path / "out")
    assert manifest["schema"]["encodings"] == {"flag": "uint8", "zip": "str", "label": "int64"}
    rows = read_rows(manifest, tmp_path / "c")
    assert sum(int(r["flag"]) for r in rows) == sum(1 for i in range(300) if i % 3)
    assert {r["zip"] for r in rows} == {str(10000 + i) for i in range(7)}


def test_parquet_with_fixed_shape_arrays_and_image_bytes(tmp_path):
    rng = np.random.default_rng(2)
    n = 300
    vectors = rng.normal(size=(n, 4)).astype(np.float32)
    pixels = rng.integers(0, 256, (n, 6, 6), dtype=np.uint8)
    t = pa.table({
        "vec": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), 4),
        "photo": pa.array([image_bytes(p, "PNG") for p in pixels], pa.binary()),
        "label": rng.integers(0, 3, n),
    })
    write_parquet(tmp_path / "in.parquet", t)
    manifest = prepare(cfg(tmp_path / "in.parquet"), name="t", out_root=tmp_path / "out")
    assert manifest["schema"]["encodings"] == {"vec": "ndarray:float32:4", "photo": "png", "label": "int64"}
    assert manifest["schema"]["array_columns"] == ["vec"] and manifest["schema"]["image_columns"] == ["photo"]
    rows = read_rows(manifest, tmp_path / "c")
    got = {r["vec"].tobytes(): np.asarray(r["photo"]).tobytes() for r in rows}
    assert got == {v.tobytes(): p.tobytes() for v, p in zip(vectors, pixels)}

    vectors[7, 2] = np.nan
    bad = t.set_column(0, "vec", pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), 4))
    write_parquet(tmp_path / "bad.parquet", bad)
    with pytest.raises(DataError, match="bad.parquet: row 7, column 'vec': array holds NaN or inf"):
        prepare(cfg(tmp_path / "bad.parquet"), name="t", out_root=tmp_path / "out")
