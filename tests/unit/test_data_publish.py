"""Publishing: versions are content digests, the worker count follows the planned work, splits stay put when rows
are appended, and interval versions read as one window with merged statistics. With worker processes (the same
output for any worker count, a kill mid-write): tests/integration/test_prep_workers.py."""

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pipeline.data.prepare import convert, sources
from pipeline.data.prepare.version import prepare
from pipeline.data.read.training_data import TrainingData
from pipeline.data.versions import windows
from pipeline.data.versions.manifest import read_preprocessing
from pipeline.errors import DataError
from tests.datafiles import (
    cfg,
    dataset_dir,
    read_rows,
    streaming_dataset,
    table,
    write_parquet,
)


def test_the_shard_and_index_digests_in_the_manifest_match_the_files(tmp_path):
    import xxhash

    write_parquet(tmp_path / "in.parquet", table(1000))
    manifest = prepare(cfg(tmp_path / "in.parquet", unit_bytes=6_000), name="t", out_root=tmp_path / "out")
    for split, shards in manifest["shards"].items():
        for entry in [*shards, manifest["indexes"][split]]:
            data = (dataset_dir(manifest) / split / entry["basename"]).read_bytes()
            assert entry["xxh3_128"] == xxhash.xxh3_128(data).hexdigest() and entry["bytes"] == len(data)
        assert sum(s["samples"] for s in shards) == manifest["splits"][split]


def test_the_worker_count_follows_the_planned_work():
    def units(count: int, mib: int) -> list[sources.Unit]:
        return [sources.Unit(i, (), size_bytes=mib << 20) for i in range(count)]

    # 60,000 28x28 IDX images: well under a second of work, less than starting a worker costs.
    assert convert.plan_workers(units(3, 15), "idx", 2) == 1
    # 5,000,000 tabular rows: seconds of work for each of 2, 4 or 8 processes.
    assert convert.plan_workers(units(28, 16), "parquet", 2) == 2
    assert convert.plan_workers(units(28, 16), "parquet", 4) == 4
    assert 4 < convert.plan_workers(units(28, 16), "parquet", 64) < 28  # not one process per unit
    assert convert.plan_workers(units(1, 4096), "parquet", 4) == 1  # one unit: one process, however big


def test_a_small_job_runs_in_the_preparing_process_alone(tmp_path, monkeypatch):
    def no_pool(*args, **kwargs):
        raise AssertionError("a worker pool was started for a small job")

    monkeypatch.setattr(convert, "ProcessPoolExecutor", no_pool)
    write_parquet(tmp_path / "in.parquet", table(3000), row_group_size=100)
    manifest = prepare(cfg(tmp_path / "in.parquet", workers=2, unit_bytes=8_000), name="t", out_root=tmp_path / "out")
    assert manifest["units"] >= 4 and manifest["workers"] == 1


def test_splits_stay_put_when_rows_are_appended(tmp_path):
    first = table(500).append_column("id", pa.array(np.arange(500)))
    write_parquet(tmp_path / "in" / "a.parquet", first)
    before = prepare(cfg(tmp_path / "in"), name="t", out_root=tmp_path / "out")
    more = table(800, seed=5).append_column("id", pa.array(np.arange(800)))
    appended = pa.concat_tables([first, more.slice(500)])  # the same first 500 rows, then 300 more
    write_parquet(tmp_path / "in" / "a.parquet", appended)
    write_parquet(tmp_path / "in" / "0-new.parquet", table(200, seed=9).append_column("id", pa.array(np.arange(200) + 10_000)))
    after = prepare(cfg(tmp_path / "in"), name="t", out_root=tmp_path / "out")
    assert after["version"] != before["version"]

    def split_of(manifest, cache):
        return {int(r["id"]): r["_split"] for r in read_rows(manifest, tmp_path / cache)}

    old, new = split_of(before, "c1"), split_of(after, "c2")
    assert len(new) == 1000 and {i: new[i] for i in old} == old
    assert set(old.values()) == {"train", "val", "test"}


def _day(day: str, rows: int, seed: int, colors: list[str]) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({"a": rng.normal(seed, 1.0, rows), "color": rng.choice(colors, rows),
                     "label": rng.choice(["cat", "dog"], rows)})


def test_a_backfill_of_three_intervals_reads_as_one_window(tmp_path):
    days = ["2026-11-27", "2026-11-28", "2026-11-29"]
    colors = [["red"], ["red", "green"], ["green", "violet"]]  # violet appears on the last day only
    for i, day in enumerate(days):
        write_parquet(tmp_path / "in" / f"dt={day}" / "part-0.parquet", _day(day, 400, i, colors[i]))
    manifests = []
    for i, day in enumerate(days):
        end = days[i + 1] if i + 1 < len(days) else "2026-11-30"
        manifests.append(prepare(cfg(tmp_path / "in"), name="daily", out_root=tmp_path / "out",
                                      interval=(f"{day}T00:00:00+00:00", f"{end}T00:00:00+00:00")))
    assert len({m["version"] for m in manifests}) == 3
    assert [read_preprocessing(dataset_dir(m))["vocab"]["color"] for m in manifests] == [
        ["<unk>", "red"], ["<unk>", "green", "red"], ["<unk>", "green", "violet"]]

    window = windows.resolve(tmp_path / "out", "daily", "2026-11-30T00:00:00+00:00", 3)
    assert list(window.versions) == [m["version"] for m in manifests]
    data = TrainingData.open(list(window.uris), tmp_path / "cache")
    prep_all = data.preprocessing
    assert prep_all["vocab"]["color"] == ["<unk>", "green", "red", "violet"]
    train_a = np.concatenate([[r["a"] for r in read_rows(m, tmp_path / "c", "train")] for m in manifests])
    assert prep_all["mean"][0] == pytest.approx(train_a.mean(), abs=1e-9)
    assert prep_all["std"][0] == pytest.approx(train_a.std(), abs=1e-9)

    # One StreamingDataset over three streams; collate encodes with the window's vocabulary.
    ds = streaming_dataset(data, tmp_path / "reference", "train")
    assert ds.num_samples == data.rows("train") == sum(m["splits"]["train"] for m in manifests)
    batch = data.collate([ds[i] for i in range(ds.num_samples)])
    assert batch["num"].shape == (ds.num_samples, 1) and str(batch["num"].dtype) == "torch.float32"
    codes = set(batch["cat"][:, 0].tolist())
    assert codes == {1, 2, 3}  # green, red, violet: every day's categories, one code each
    assert sorted(batch["label"].unique().tolist()) == [0, 1]

    # The newest two intervals only.
    two = windows.resolve(tmp_path / "out", "daily", "2026-11-30T00:00:00+00:00", 2)
    assert list(two.versions) == [m["version"] for m in manifests[1:]]
    frame, labels = TrainingData.open(list(two.uris), tmp_path / "c2").frame("test")
    assert len(frame) == len(labels) == sum(m["splits"]["test"] for m in manifests[1:])


def test_versions_of_different_schemas_do_not_mix(tmp_path):
    write_parquet(tmp_path / "x.parquet", table(300))
    write_parquet(tmp_path / "y.parquet", table(300).drop_columns(["b"]))
    x = prepare(cfg(tmp_path / "x.parquet"), name="x", out_root=tmp_path / "out")
    y = prepare(cfg(tmp_path / "y.parquet"), name="y", out_root=tmp_path / "out")
    with pytest.raises(DataError, match="a window reads versions of one schema"):
        TrainingData.open([x["uri"], y["uri"]], tmp_path / "cache")


def test_a_triggered_run_waits_for_the_days_written_beside_the_one_that_triggered_it(tmp_path):
    """A backfill's days are prepared side by side: the run that the first day's event creates must not read a
    window without the days that are published a moment later."""
    import shutil
    import threading

    from pipeline.data import demo
    from pipeline.data.prepare import publish

    demo.write_partitions(tmp_path / "raw", ["2026-11-28", "2026-11-29"], 300, seed=4)
    out = tmp_path / "out"
    first = prepare(cfg(tmp_path / "raw"), name="daily", out_root=out, interval=("2026-11-28", "2026-11-29"))
    writing = publish.temporary_folder(out / "daily" / "next")  # the second day's writer, at work in this process

    def finish_the_second_day():
        prepare(cfg(tmp_path / "raw"), name="daily", out_root=out, interval=("2026-11-29", "2026-11-30"))
        shutil.rmtree(writing)

    event = type("Event", (), {"extra": windows.asset_extra(windows.summary({**first, "skipped": False}, 0.0))})
    writer = threading.Thread(target=finish_the_second_day)
    writer.start()
    try:
        assert windows.triggering_window({"daily": [event]}, out) == {"dataset": "daily", "end": "2026-11-30"}
    finally:
        writer.join()

    # A temporary folder whose writer is gone holds no run up.
    no_process = int(Path("/proc/sys/kernel/pid_max").read_text())  # process ids stay below it
    (out / "daily" / f".tmp-x-{os.uname().nodename}-{no_process}-0000").mkdir()
    assert publish.wait_for_writers(out / "daily", timeout_s=0) == []
