"""Verified versions: a shard changed after publication (bit rot, a bad copy, a partial sync) is found when
prepare_data reuses the version, which then publishes it again from its source with the damaged copy moved
aside, and by every reader before it decodes the shard, which fails naming version, split, shard, both
digests and the command that republishes it."""

import json
import shutil

import pytest

from pipeline.data.prepare.republish import republish
from pipeline.data.prepare.version import prepare
from pipeline.data.read.training_data import TrainingData
from pipeline.data.versions import integrity, windows
from pipeline.errors import DataError, UserError
from tests.datafiles import cfg, dataset_dir, table, write_parquet


def _flip(path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of a file, as a bad disk or a bad copy does."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, min(middle + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def version(tmp_path):
    write_parquet(tmp_path / "in" / "rows.parquet", table(1200))
    return prepare(cfg(tmp_path / "in" / "rows.parquet"), name="t", out_root=tmp_path / "out")


def _first_shard(manifest, split="train"):
    entry = manifest["shards"][split][0]
    return entry, dataset_dir(manifest) / split / entry["basename"]


def test_an_intact_version_is_reused_and_a_damaged_one_is_published_again_beside_the_moved_copy(version, tmp_path):
    config = cfg(tmp_path / "in" / "rows.parquet")
    assert prepare(config, name="t", out_root=tmp_path / "out")["skipped"]

    entry, shard = _first_shard(version)
    good = shard.read_bytes()
    _flip(shard)
    again = prepare(config, name="t", out_root=tmp_path / "out")
    assert not again["skipped"] and again["version"] == version["version"]
    assert shard.read_bytes() == good and integrity.check_version(dataset_dir(again), again) == []
    (aside,) = (tmp_path / "out" / "t").glob(f".damaged-{version['version']}-*")
    assert (aside / "train" / entry["basename"]).read_bytes() != good  # kept, not deleted, out of readers' sight
    assert [m["version"] for m in windows.published(tmp_path / "out" / "t")] == [version["version"]]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "index"])
def test_check_version_names_each_kind_of_damage(version, damage):
    entry, shard = _first_shard(version)
    if damage == "flip":
        _flip(shard)
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "delete":
        shard.unlink()
    else:
        entry, shard = version["indexes"]["train"], dataset_dir(version) / "train" / "index.json"
        _flip(shard, 4)
    (found,) = integrity.check_version(dataset_dir(version), version)
    assert (found.split, found.basename) == ("train", entry["basename"])
    expected = {"flip": f"xxh3_128 {entry['xxh3_128']}", "truncate": f"{entry['bytes']} bytes",
                "delete": "the file", "index": f"xxh3_128 {entry['xxh3_128']}"}[damage]
    assert found.expected == expected and found.found != found.expected


def test_a_damaged_manifest_is_moved_aside_and_the_version_published_again(version, tmp_path):
    manifest_path = dataset_dir(version) / "manifest.json"
    manifest_path.write_text(manifest_path.read_text()[:-40])
    again = prepare(cfg(tmp_path / "in" / "rows.parquet"), name="t", out_root=tmp_path / "out")
    assert not again["skipped"] and json.loads(manifest_path.read_text())["version"] == version["version"]
    assert len(list((tmp_path / "out" / "t").glob(".damaged-*"))) == 1


def _assert_names_everything(message: str, manifest, entry) -> None:
    assert f"dataset t version {manifest['version']} at {dataset_dir(manifest)} is damaged" in message
    assert f"split train, file {entry['basename']}: xxh3_128 " in message
    assert f"the manifest says xxh3_128 {entry['xxh3_128']}" in message
    assert f"python -m pipeline.data.prepare.republish {dataset_dir(manifest)}" in message


def test_a_rank_fails_before_decoding_a_damaged_shard(version, tmp_path):
    entry, shard = _first_shard(version)
    _flip(shard)
    loader = TrainingData.open([version["uri"]], tmp_path / "cache").loader(
        "train", batch_size=32, shuffle=False, seed=0, transform=lambda columns: columns)
    with pytest.raises(DataError) as raised:
        for _ in loader:
            pass
    assert isinstance(raised.value, UserError)  # a rank reports it; the task fails without a retry
    _assert_names_everything(str(raised.value), version, entry)
    assert not (tmp_path / "cache" / version["version"] / "train" / entry["basename"]).exists()  # not cached


def test_reading_a_whole_split_checks_it_too(version, tmp_path):
    """What registration and evaluation read (``read_split``), in the task process."""
    entry, shard = _first_shard(version)
    _flip(shard)
    with pytest.raises(DataError) as raised:
        TrainingData.open([version["uri"]], tmp_path / "cache").read_split("train")
    _assert_names_everything(str(raised.value), version, entry)


def test_republish_rebuilds_from_the_source_or_says_why_it_cannot(version, tmp_path):
    entry, shard = _first_shard(version)
    good = shard.read_bytes()
    assert republish(dataset_dir(version))["skipped"]

    _flip(shard)
    made = republish(dataset_dir(version))
    assert not made["skipped"] and made["version"] == version["version"] and shard.read_bytes() == good

    _flip(shard)
    write_parquet(tmp_path / "in" / "rows.parquet", table(1200, seed=5))  # the source changed since
    with pytest.raises(DataError, match=r"the source has changed since and now gives version \w+ .*Restore version"):
        republish(dataset_dir(version))
    assert integrity.check_version(dataset_dir(version), version)  # the damaged copy was left in place

    shutil.rmtree(tmp_path / "in")
    with pytest.raises(DataError, match="cannot be published again from its source: .*does not exist"):
        republish(dataset_dir(version))


def test_a_windows_damaged_version_is_published_again_before_it_is_read(tmp_path):
    from pipeline.data import demo

    demo.write_partitions(tmp_path / "raw", ["2026-11-01", "2026-11-02"], 300, seed=1)
    days = [prepare(cfg(tmp_path / "raw"), name="d", out_root=tmp_path / "out", interval=(start, end))
            for start, end in (("2026-11-01", "2026-11-02"), ("2026-11-02", "2026-11-03"))]
    entry, shard = _first_shard(days[0])
    good = shard.read_bytes()
    _flip(shard)
    window = windows.resolve(tmp_path / "out", "d", "2026-11-03", 2)
    assert window.versions == tuple(d["version"] for d in days) and shard.read_bytes() == good


def test_versions_published_before_xxh3_digests_are_checked_by_their_xxh64(version):
    import xxhash

    old = json.loads(json.dumps(version))
    old.pop("indexes")
    for split, shards in old["shards"].items():
        for s in shards:
            data = (dataset_dir(version) / split / s["basename"]).read_bytes()
            s.pop("xxh3_128"), s.pop("bytes")
            s["xxh64"] = xxhash.xxh64(data).hexdigest()
    assert integrity.check_version(dataset_dir(version), old) == []
    entry, shard = _first_shard(old)
    _flip(shard)
    (found,) = integrity.check_version(dataset_dir(version), old)
    assert found.basename == entry["basename"] and found.expected == f"xxh64 {entry['xxh64']}"
