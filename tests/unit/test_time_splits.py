"""Splits by time for data without labels (interactions): each group's newest rows held out, or global
time cut-offs; written as real MDS and read back."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import DataConfig
from pipeline.data.prepare.version import prepare
from pipeline.data.read.training_data import TrainingData
from pipeline.errors import ConfigError, DataError


def _interactions(path: Path, *, rows_per_user: dict[str, int], seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    users, items, times = [], [], []
    for user, n in rows_per_user.items():
        t = np.sort(rng.choice(10_000, size=n, replace=False))
        users += [user] * n
        items += [f"i{k}" for k in rng.integers(0, 20, n)]
        times += t.tolist()
    order = rng.permutation(len(users))  # rows in no particular order: the split must sort by time
    table = pa.table({"user_id": np.array(users)[order], "item_id": np.array(items)[order],
                      "timestamp": np.array(times, dtype=np.int64)[order]})
    pq.write_table(table, path, row_group_size=7)  # several record batches per unit
    return path


def _cfg(path: Path, **overrides) -> DataConfig:
    settings = {"label_column": "", "categorical_columns": ["user_id", "item_id"], "time_column": "timestamp",
                "batch_rows": 5, "shard_size_limit_bytes": 1 << 12}
    return DataConfig(input_path=str(path), **(settings | overrides))


def _split_rows(manifest, tmp_path) -> dict[str, list[tuple[str, int]]]:
    data = TrainingData.open([manifest["uri"]], tmp_path / "cache")
    out = {}
    for split in ("train", "val", "test"):
        columns = data.read_split(split) if manifest["splits"][split] else {"user_id": [], "timestamp": []}
        out[split] = sorted(zip(map(str, columns["user_id"]), map(int, columns["timestamp"])))
    return out


def test_last_per_group_holds_out_each_users_newest_rows(tmp_path):
    path = _interactions(tmp_path / "in.parquet", rows_per_user={"a": 6, "b": 4, "c": 2, "d": 9})
    manifest = prepare(_cfg(path, split_by="last_per_group", group_column="user_id", val_per_group=1,
                                 test_per_group=2), name="i", out_root=tmp_path / "out")
    rows = _split_rows(manifest, tmp_path)
    assert manifest["label_classes"] == [] and manifest["schema"]["label_kind"] == "none"
    assert manifest["time_split"]["by"] == "last_per_group" and manifest["time_split"]["groups_held_out"] == 3
    for user, n in {"a": 6, "b": 4, "d": 9}.items():
        times = sorted(t for u, t in rows["train"] + rows["val"] + rows["test"] if u == user)
        assert len(times) == n
        assert [t for u, t in rows["test"] if u == user] == times[-2:]
        assert [t for u, t in rows["val"] if u == user] == times[-3:-2]
    # Two rows are not more than the three held out: the user keeps them all for training.
    assert [u for u, _ in rows["train"]].count("c") == 2 and all(u != "c" for u, _ in rows["test"] + rows["val"])
    assert manifest["splits"] == {"train": 21 - 9, "val": 3, "test": 6}


def test_time_split_puts_the_newest_rows_in_test_by_global_cut_offs(tmp_path):
    """From CSV: every cell is text there; the time column is declared numeric."""
    import pyarrow.csv as pv

    path = _interactions(tmp_path / "in.parquet", rows_per_user={f"u{k}": 10 for k in range(20)})
    pv.write_csv(pq.read_table(path), tmp_path / "in.csv")
    manifest = prepare(_cfg(tmp_path / "in.csv", split_by="time", val_fraction=0.1, test_fraction=0.2,
                                 column_encodings=["timestamp:int64"]), name="i", out_root=tmp_path / "out")
    rows = _split_rows(manifest, tmp_path)
    newest_train = max(t for _, t in rows["train"])
    assert min(t for _, t in rows["val"]) > newest_train
    assert min(t for _, t in rows["test"]) > max(t for _, t in rows["val"])
    assert abs(manifest["splits"]["test"] - 40) <= 2 and abs(manifest["splits"]["val"] - 20) <= 2


def test_a_changed_split_setting_is_another_dataset_version(tmp_path):
    path = _interactions(tmp_path / "in.parquet", rows_per_user={"a": 6, "b": 5})
    by_group = prepare(_cfg(path, split_by="last_per_group", group_column="user_id"), name="i",
                            out_root=tmp_path / "out")
    more = prepare(_cfg(path, split_by="last_per_group", group_column="user_id", test_per_group=2), name="i",
                        out_root=tmp_path / "out")
    assert by_group["version"] != more["version"]


def test_bad_time_split_input_fails_naming_the_file_row_and_setting(tmp_path):
    rows = {"user_id": ["a", "a", "b"], "item_id": ["x", "y", "z"], "timestamp": [1.0, None, 3.0]}
    pq.write_table(pa.table(rows), tmp_path / "nulls.parquet")
    with pytest.raises(DataError, match=r"nulls.parquet.*row 1.*'timestamp'.*expected a number") as err:
        prepare(_cfg(tmp_path / "nulls.parquet", split_by="time"), name="i", out_root=tmp_path / "out")
    print(err.value)
    assert not (tmp_path / "out" / "i").exists() or not any((tmp_path / "out" / "i").iterdir())

    pq.write_table(pa.table({"user_id": ["a", "b"], "item_id": ["x", "y"], "when": ["17", "yesterday"]}),
                   tmp_path / "text.parquet")
    with pytest.raises(DataError, match=r"text.parquet.*row 1, column 'when': time is 'yesterday'; expected a number"):
        prepare(_cfg(tmp_path / "text.parquet", split_by="time", time_column="when"), name="i",
                     out_root=tmp_path / "out")
    pq.write_table(pa.table({"user_id": ["a"], "item_id": ["x"], "when": [b"\x00"]}), tmp_path / "bytes.parquet")
    with pytest.raises(DataError, match="data.time_column 'when' has type binary; expected numbers"):
        prepare(_cfg(tmp_path / "bytes.parquet", split_by="time", time_column="when"), name="i",
                     out_root=tmp_path / "out")
    with pytest.raises(ConfigError, match="needs data.group_column"):
        prepare(_cfg(tmp_path / "nulls.parquet", split_by="last_per_group"), name="i", out_root=tmp_path / "out")
