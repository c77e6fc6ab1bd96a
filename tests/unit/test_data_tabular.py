import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import DataConfig
from pipeline.data import local_path
from pipeline.data.prepare import splits
from pipeline.data.prepare.version import prepare
from pipeline.data.read.training_data import TrainingData
from pipeline.data.versions.manifest import read_preprocessing
from pipeline.errors import DataError
from tests.datafiles import table as make_table


def _cfg(path: Path, **overrides) -> DataConfig:
    return DataConfig(input_path=str(path), label_column="label", shard_size_limit_bytes=1 << 12, **overrides)


def test_parquet_to_mds_round_trip(tmp_path):
    table = make_table()
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=100)
    manifest = prepare(_cfg(tmp_path / "in.parquet", batch_rows=128), name="t", out_root=tmp_path / "out")
    dataset_dir = local_path(manifest["uri"])

    assert manifest["splits"]["train"] + manifest["splits"]["val"] + manifest["splits"]["test"] == 600
    assert len(list((dataset_dir / "train").glob("part-*/shard.*.mds.zstd"))) > 1  # the size limit forced shards
    assert manifest["schema"]["numeric_columns"] == ["a", "b"]
    assert manifest["schema"]["categorical_columns"] == ["color"]
    assert manifest["label_classes"] == ["cat", "dog"]

    frames, labels = [], []
    for split in splits.SPLITS:
        frame, y = TrainingData.open([manifest["uri"]], tmp_path / "cache").frame(split)
        assert len(frame) == manifest["splits"][split]
        frames.append(frame)
        labels.append(y)
    got = sorted(
        (round(float(a), 4), int(b), c, manifest["label_classes"][y])
        for frame, ys in zip(frames, labels)
        for a, b, c, y in zip(frame["a"], frame["b"], frame["color"], ys)
    )
    want = sorted(
        (round(a, 4), b, c, y)
        for a, b, c, y in zip(*(table.column(n).to_pylist() for n in ("a", "b", "color", "label")))
    )
    assert got == want


def test_statistics_come_from_the_training_split(tmp_path):
    pq.write_table(make_table(), tmp_path / "in.parquet")
    manifest = prepare(_cfg(tmp_path / "in.parquet"), name="t", out_root=tmp_path / "out")
    dataset_dir = local_path(manifest["uri"])
    preprocessing = read_preprocessing(dataset_dir)
    train, _ = TrainingData.open([manifest["uri"]], tmp_path / "cache").frame("train")
    assert preprocessing["mean"][0] == pytest.approx(train["a"].mean(), abs=1e-5)
    assert preprocessing["vocab"]["color"] == ["<unk>", "blue", "green", "red"]


def test_same_inputs_give_the_same_version_and_skip_the_work(tmp_path):
    pq.write_table(make_table(), tmp_path / "in.parquet")
    first = prepare(_cfg(tmp_path / "in.parquet"), name="t", out_root=tmp_path / "out")
    index = (local_path(first["uri"]) / "train" / "index.json").read_bytes()
    second = prepare(_cfg(tmp_path / "in.parquet"), name="t", out_root=tmp_path / "out")
    assert (first["skipped"], second["skipped"]) == (False, True)
    assert second["version"] == first["version"]
    assert (local_path(second["uri"]) / "train" / "index.json").read_bytes() == index
    changed = prepare(_cfg(tmp_path / "in.parquet", split_seed=1), name="t", out_root=tmp_path / "out")
    assert changed["version"] != first["version"]
    assert not [p for p in (tmp_path / "out" / "t").iterdir() if p.name.startswith(".tmp")]


def test_splits_are_stable_when_rows_are_appended():
    keys = np.arange(10_000, dtype=np.uint64)
    before = splits.assign(keys[:6_000], seed=3, val_fraction=0.1, test_fraction=0.2)
    after = splits.assign(keys, seed=3, val_fraction=0.1, test_fraction=0.2)
    assert np.array_equal(before, after[:6_000])
    fractions = np.bincount(after, minlength=3) / len(after)
    assert fractions == pytest.approx([0.7, 0.1, 0.2], abs=0.02)


def test_a_key_column_assigns_splits_by_key_not_position(tmp_path):
    table = make_table(300).append_column("id", pa.array([f"user-{i}" for i in range(300)]))
    pq.write_table(table, tmp_path / "a.parquet")
    reversed_table = table.take(pa.array(range(299, -1, -1)))
    pq.write_table(reversed_table, tmp_path / "b.parquet")

    def test_ids(name):
        m = prepare(_cfg(tmp_path / name, key_column="id"), name=name, out_root=tmp_path / "out")
        assert "id" not in m["schema"]["numeric_columns"] + m["schema"]["categorical_columns"]
        frame, _ = TrainingData.open([m["uri"]], tmp_path / f"c-{name}").frame("test")
        return sorted(zip(frame["a"].round(6), frame["b"]))

    assert test_ids("a.parquet") == test_ids("b.parquet")


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda d: d / "nope.parquet", "does not exist"),
        (lambda d: _write(d, make_table().drop_columns(["label"])), "data.label_column 'label' is not a column; the columns are ['a', 'b', 'color']"),
        (lambda d: _write(d, make_table().append_column("ts", pa.array(np.arange(600).astype("datetime64[s]")))), "feature column 'ts' has type timestamp[ms]; features must be numeric"),
        (lambda d: _write(d, make_table().set_column(0, "a", pa.array([1.0] * 599 + [float("nan")]))), "row 599, column 'a': value nan; expected a finite number"),
        (lambda d: _write(d, make_table().set_column(3, "label", pa.array([1.5] * 600))), "label column 'label' has type double"),
        (lambda d: _write(d, make_table().set_column(3, "label", pa.array(["x"] * 600))), "expected at least 2 classes"),
        (lambda d: _write(d, make_table().slice(0, 0)), "the input has no rows"),
    ],
    ids=["missing-file", "missing-label", "non-numeric-feature", "nan-feature", "float-label", "one-class", "empty"],
)
def test_bad_input_is_refused_with_a_clear_error_and_nothing_published(tmp_path, make, expected):
    path = make(tmp_path)
    with pytest.raises(DataError) as err:
        prepare(_cfg(path), name="t", out_root=tmp_path / "out")
    assert expected in str(err.value)
    published = list((tmp_path / "out" / "t").iterdir()) if (tmp_path / "out" / "t").exists() else []
    assert published == []


def _write(directory: Path, table: pa.Table) -> Path:
    path = directory / "bad.parquet"
    pq.write_table(table, path)
    return path


def test_a_folder_of_parquet_files_is_one_input(tmp_path):
    table = make_table(400)
    (tmp_path / "in").mkdir()
    pq.write_table(table.slice(0, 250), tmp_path / "in" / "part-0.parquet")
    pq.write_table(table.slice(250), tmp_path / "in" / "part-1.parquet")
    manifest = prepare(_cfg(tmp_path / "in"), name="t", out_root=tmp_path / "out")
    assert sum(manifest["splits"].values()) == 400
    assert [Path(s["path"]).name for s in manifest["sources"]] == ["part-0.parquet", "part-1.parquet"]
    assert json.loads((local_path(manifest["uri"]) / "manifest.json").read_text())["version"] == manifest["version"]
