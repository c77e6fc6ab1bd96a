"""Dataset versions on an object store (``PIPELINE_DATA_DIR=s3://...``), against a real S3 API server (moto's, on
127.0.0.1): published with the manifest last under a lease, reused with a check that reads no shard, set aside and
published again when damaged, never seen while partial (and waited for while its lease is fresh), one version from
two publishers at once; and read back,
through streaming's downloader into a local cache, as the same batches in the same order as the local copy,
resumable at the exact sample. A missing bucket is a user error naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline import storage
from pipeline.data.prepare import publish_remote
from pipeline.data.prepare.version import prepare
from pipeline.data.read.training_data import TrainingData
from pipeline.data.versions import windows
from pipeline.errors import ConfigError, DataError
from tests.datafiles import as_columns, assert_same_batches, cfg, check_mid_epoch_resume, table, write_parquet


@pytest.fixture
def source(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PIPELINE_STAGING_DIR", str(tmp_path / "staging"))
    import numpy as np
    import pyarrow as pa

    return write_parquet(tmp_path / "in.parquet", table(700).append_column("id", pa.array(np.arange(700))))


def _keys(root: str) -> dict[str, int]:
    return storage.sizes(root)


def test_a_version_is_published_to_the_bucket_and_read_back_as_the_local_copy_reads(s3, source, tmp_path):
    remote = prepare(cfg(source), name="t", out_root=f"{s3}/data")
    local = prepare(cfg(source), name="t", out_root=tmp_path / "local")
    assert remote["version"] == local["version"] and not remote["skipped"]
    assert remote["uri"] == f"{s3}/data/t/{remote['version']}"
    assert remote["shards"] == local["shards"] and remote["indexes"] == local["indexes"]

    keys = _keys(f"{s3}/data/t/{remote['version']}")
    assert "manifest.json" in keys and publish_remote.LEASE not in keys  # the lease is gone with its writer
    for split, shards in remote["shards"].items():
        for shard in shards:
            assert keys[f"{split}/{shard['basename']}"] == shard["bytes"]
    assert list((tmp_path / "staging").iterdir()) == []  # the staging folder went with the upload

    # Ranks read through streaming's downloader into their cache: the same batches, the same order, as locally.
    kwargs = dict(batch_size=32, shuffle=True, seed=3, transform=as_columns)
    from_s3 = TrainingData.open([remote["uri"]], tmp_path / "cache-s3")
    from_disk = TrainingData.open([local["uri"]], tmp_path / "cache-disk")
    assert from_s3.preprocessing == from_disk.preprocessing
    assert_same_batches(list(from_s3.loader("train", **kwargs)), list(from_disk.loader("train", **kwargs)))
    cached = sorted((tmp_path / "cache-s3" / remote["version"] / "train").rglob("shard.*.mds"))
    assert len(cached) == len(remote["shards"]["train"])

    # A second publish reads the manifest, one listing and the indexes: skipped.
    again = prepare(cfg(source), name="t", out_root=f"{s3}/data")
    assert again["skipped"] and again["version"] == remote["version"]
    assert [m["version"] for m in windows.published(f"{s3}/data/t")] == [remote["version"]]


def test_reading_from_the_bucket_resumes_at_the_exact_sample(s3, source, tmp_path):
    manifest = prepare(cfg(source), name="t", out_root=f"{s3}/data")
    check_mid_epoch_resume(manifest, tmp_path, num_workers=0)


def test_a_damaged_remote_version_is_set_aside_and_published_again(s3, source, caplog):
    manifest = prepare(cfg(source), name="t", out_root=f"{s3}/data")
    root = manifest["uri"]
    shard = manifest["shards"]["train"][0]["basename"]
    storage.write_bytes(storage.join(root, "train", shard), b"short")  # a bad copy: the wrong size

    with pytest.raises(DataError, match=f"split train, file {shard}: 5 bytes"):
        TrainingData.open([root], Path(os.environ["PIPELINE_STAGING_DIR"]) / "c").shards("train").prepare(0)

    again = prepare(cfg(source), name="t", out_root=f"{s3}/data")
    assert not again["skipped"] and again["version"] == manifest["version"]
    keys = _keys(root)
    assert keys[f"train/{shard}"] == manifest["shards"]["train"][0]["bytes"]
    assert [k for k in keys if k.startswith("manifest.damaged-")]  # the damaged one's manifest, kept aside
    assert "is damaged: split train, file" in caplog.text


def test_a_partial_upload_is_never_a_version_and_is_removed(s3, source, monkeypatch):
    def fail_before_the_manifest(*args, before_last=None, **kwargs):
        fs, root = storage.filesystem(args[1])
        fs.pipe_file(f"{root}/train/index.json", b"{}")  # some files have landed
        raise ConnectionError("the store went away mid-upload")

    monkeypatch.setattr(storage, "upload", fail_before_the_manifest)
    with pytest.raises(ConnectionError):
        prepare(cfg(source), name="t", out_root=f"{s3}/data")
    assert windows.published(f"{s3}/data/t") == []
    assert not any(_keys(f"{s3}/data/t").values())  # neither the partial files nor the lease stayed


def test_a_dead_writers_partial_upload_is_invisible_and_its_stale_lease_taken_over(s3, source, monkeypatch):
    version = prepare(cfg(source), name="probe", out_root=f"{s3}/probe")["version"]
    final = f"{s3}/data/t/{version}"
    # What a writer killed mid-upload leaves: its lease and some files, no manifest.
    storage.write_bytes(storage.join(final, publish_remote.LEASE), b'{"token": "dead"}')
    storage.write_bytes(storage.join(final, "train", "index.json"), b"{}")
    assert windows.published(f"{s3}/data/t") == []
    with pytest.raises(DataError, match="no published dataset version here"):
        TrainingData.open([final], Path(os.environ["PIPELINE_STAGING_DIR"]) / "c")
    assert publish_remote.wait_for_writers(f"{s3}/data/t", timeout_s=0) == [version]  # a fresh lease: being written

    monkeypatch.setattr(publish_remote, "STALE_LEASE_S", 0.5)
    monkeypatch.setattr(publish_remote, "POLL_S", 0.1)
    import time

    time.sleep(1.0)
    assert publish_remote.wait_for_writers(f"{s3}/data/t", timeout_s=0) == []  # stale: its writer is gone
    made = prepare(cfg(source), name="t", out_root=f"{s3}/data")
    assert not made["skipped"] and made["uri"] == final
    assert publish_remote.LEASE not in _keys(final)
    assert len(TrainingData.open([final], Path(os.environ["PIPELINE_STAGING_DIR"]) / "c2").read_split("train")["id"]) \
        == made["splits"]["train"]


_PUBLISH = """
import json, sys
from pipeline.data.prepare.version import prepare
from tests.datafiles import cfg
manifest = prepare(cfg(sys.argv[1]), name="t", out_root=sys.argv[2])
print(json.dumps({k: manifest[k] for k in ("skipped", "version", "created_at")}))
"""


def test_two_publishers_of_one_version_publish_it_once(s3, source, tmp_path):
    import subprocess
    import sys

    from pipeline import deployment

    # Processes of their own (not multiprocessing's: its resource tracker would outlive the test as a child).
    env = {**os.environ, "PIPELINE_STAGING_DIR": str(tmp_path / "staging"), "PYTHONPATH": str(deployment.PROJECT_ROOT)}
    publishers = [subprocess.Popen([sys.executable, "-c", _PUBLISH, str(source), f"{s3}/data"], env=env,
                                   stdout=subprocess.PIPE, text=True) for _ in range(2)]
    results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in publishers]
    assert [p.returncode for p in publishers] == [0, 0]
    assert sorted(r["skipped"] for r in results) == [False, True], results  # one wrote it, the other waited
    assert len({r["version"] for r in results}) == 1 and len({r["created_at"] for r in results}) == 1
    final = f"{s3}/data/t/{results[0]['version']}"
    manifest = json.loads(storage.read_bytes(storage.join(final, "manifest.json")))
    assert publish_remote.LEASE not in _keys(final)
    from pipeline.data.versions import integrity

    assert integrity.check_version(final, manifest) == []


def test_a_missing_bucket_is_a_user_error_naming_it(s3, source):
    missing = s3.replace("s3://test-", "s3://gone-")
    with pytest.raises(ConfigError, match=f"bucket '{missing[5:]}' does not exist") as caught:
        prepare(cfg(source), name="t", out_root=f"{missing}/data")
    assert "key 'data/t/" in str(caught.value)


def test_a_publisher_waits_while_another_holds_the_versions_lease(s3, source, monkeypatch):
    import threading
    import time

    version = prepare(cfg(source), name="probe", out_root=f"{s3}/probe")["version"]
    final = f"{s3}/data/t/{version}"
    lease = storage.join(final, publish_remote.LEASE)
    storage.write_bytes(lease, b'{"token": "another writer"}')  # fresh: renewed just now
    monkeypatch.setattr(publish_remote, "POLL_S", 0.1)
    made: list = []
    publisher = threading.Thread(target=lambda: made.append(prepare(cfg(source), name="t", out_root=f"{s3}/data")))
    publisher.start()
    time.sleep(3.0)
    assert publisher.is_alive() and "manifest.json" not in _keys(final)  # waiting, writing nothing
    storage.remove(lease)  # the other writer gave up (its files removed, no manifest)
    publisher.join(timeout=120)
    assert made and not made[0]["skipped"] and publish_remote.LEASE not in _keys(final)
