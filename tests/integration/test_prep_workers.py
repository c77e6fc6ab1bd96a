"""Data preparation with worker processes: the same output (and the same first error) for any worker count, bad
rows quarantined from every worker, and a kill mid-write that publishes nothing and leaves no worker behind.
Preparation in one process is in tests/unit/test_data_publish.py and tests/unit/test_data_validation.py."""

import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import deployment
from pipeline.data.prepare import convert
from pipeline.data.prepare.version import prepare
from pipeline.errors import DataError
from tests.datafiles import (
    cfg,
    dataset_dir,
    eight_bad_rows,
    published,
    table,
    write_parquet,
)
from tests.processes import wait_until_gone


@pytest.fixture(autouse=True)
def pool_for_any_job(monkeypatch):
    """Workers even for these tiny inputs, which would otherwise run in the preparing process alone."""
    monkeypatch.setattr(convert, "WORKER_START_S", 0.0)


def _index_bytes(manifest) -> dict[str, bytes]:
    return {s: (dataset_dir(manifest) / s / "index.json").read_bytes() for s in ("train", "val", "test")}


def test_rerun_is_skipped_and_the_output_is_the_same_for_any_worker_count(tmp_path):
    write_parquet(tmp_path / "in.parquet", table(3000), row_group_size=100)
    one = prepare(cfg(tmp_path / "in.parquet", workers=1, unit_bytes=8_000), name="t", out_root=tmp_path / "one")
    two = prepare(cfg(tmp_path / "in.parquet", workers=2, unit_bytes=8_000), name="t", out_root=tmp_path / "two")
    assert one["version"] == two["version"] and two["workers"] == 2
    assert len(list((dataset_dir(two) / "train").glob("part-*"))) >= 4  # units of a few 100-row groups
    assert _index_bytes(one) == _index_bytes(two)
    assert one["shards"] == two["shards"]
    assert all(s["xxh3_128"] and s["bytes"] for shards in two["shards"].values() for s in shards)

    started = time.perf_counter()
    again = prepare(cfg(tmp_path / "in.parquet", workers=2, unit_bytes=8_000), name="t", out_root=tmp_path / "two")
    assert again["skipped"] and again["version"] == two["version"]
    assert _index_bytes(again) == _index_bytes(two)
    print(f"skipped re-run: {time.perf_counter() - started:.2f} s")


def test_the_same_error_whatever_the_worker_count(tmp_path):
    t = table()
    bad = t.set_column(t.schema.get_field_index("a"), "a", pa.array([1.0] * 599 + [float("nan")]))
    write_parquet(tmp_path / "bad.parquet", bad)
    messages = set()
    for workers in (1, 2):
        with pytest.raises(DataError) as raised:
            prepare(cfg(tmp_path / "bad.parquet", workers=workers), name="t", out_root=tmp_path / "out")
        messages.add(str(raised.value))
    assert len(messages) == 1 and "row 599" in messages.pop()


def test_quarantine_keeps_bad_rows_beside_the_dataset_and_counts_them(tmp_path):
    write_parquet(tmp_path / "in.parquet", eight_bad_rows())
    manifest = prepare(
        cfg(tmp_path / "in.parquet", on_bad_rows="quarantine", max_bad_fraction=0.05, label_classes=["cat", "dog"], workers=2),
        name="t", out_root=tmp_path / "out")
    assert manifest["bad_rows"] == {"count": 8, "read": 600, "fraction": round(8 / 600, 6), "policy": "quarantine",
                                    "quarantine": "quarantine.parquet"}
    assert sum(manifest["splits"].values()) == 592 and manifest["workers"] == 2
    quarantined = pq.read_table(dataset_dir(manifest) / "quarantine.parquet").to_pylist()
    assert sorted(int(q["_source"].rsplit("row ", 1)[1]) for q in quarantined) == [3, 10, 20, 30, 50, 51, 300, 599]
    assert {q["_column"] for q in quarantined} == {"a", "label"}
    bird = next(q for q in quarantined if q["_column"] == "label")
    assert bird["label"] == "bird" and "expected one of ['cat', 'dog']" in bird["_error"]


_KILL_SCRIPT = """
import sys
from pipeline.data.prepare import convert
from pipeline.data.prepare.version import prepare
from tests.datafiles import cfg
if __name__ == "__main__":
    convert.WORKER_START_S = 0.0  # a pool even for this small job
    prepare(cfg(sys.argv[1], workers=2, unit_bytes=1, batch_rows=2_000), name="t", out_root=sys.argv[2])
"""


def test_a_kill_mid_write_publishes_nothing_and_a_rerun_publishes_a_good_version(tmp_path):
    write_parquet(tmp_path / "in.parquet", table(300_000), row_group_size=20_000)
    out = tmp_path / "out"
    script = tmp_path / "prep_job.py"
    script.write_text(_KILL_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "in.parquet"), str(out)],
                            cwd=deployment.PROJECT_ROOT, env={**os.environ, "PYTHONPATH": str(deployment.PROJECT_ROOT)})
    deadline = time.monotonic() + 120
    # Kill once shards are being written into the temporary folder.
    while not list(out.glob("t/.tmp-*/train/part-*/shard.*")):
        assert proc.poll() is None, "the preparation ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert published(out) == []
    assert list(out.glob("t/.tmp-*"))  # the dead writer's folder, which no reader looks at

    # The worker processes and their forkserver (their command lines name this test's folder) end too.
    assert wait_until_gone(str(tmp_path)) == [], "workers of the killed preparation are still running"
    manifest = prepare(cfg(tmp_path / "in.parquet", unit_bytes=1), name="t", out_root=out)
    assert sum(manifest["splits"].values()) == 300_000
    assert published(out) == [dataset_dir(manifest) / "manifest.json"]
    assert [p.name for p in (out / "t").iterdir()] == [manifest["version"]]  # stale temporaries removed
