"""Locations as folders or object-store URIs (``pipeline.storage``): which are remote, how they join, and which
store errors are the user's to fix (a missing bucket, a denied request: ``ConfigError`` naming bucket and key)."""

import pytest

from pipeline import storage
from pipeline.errors import ConfigError


def test_remote_locations_and_joins():
    assert storage.is_remote("s3://bucket/prefix") and storage.is_remote("gs://b")
    assert not storage.is_remote("/var/data") and not storage.is_remote("file:///var/data")
    assert storage.join("s3://b/p/", "name", "/v1/") == "s3://b/p/name/v1"
    assert storage.join("/var/data", "name") == "/var/data/name"


def test_local_files_read_list_and_size(tmp_path):
    (tmp_path / "v" / "train").mkdir(parents=True)
    (tmp_path / "v" / "train" / "index.json").write_bytes(b"{}")
    (tmp_path / "v" / "manifest.json").write_text('{"a": 1}')
    assert storage.read_json(tmp_path / "v" / "manifest.json") == {"a": 1}
    assert storage.sizes(tmp_path / "v") == {"manifest.json": 8, "train/index.json": 2}
    assert storage.listing(tmp_path / "v") == ["manifest.json", "train"]
    assert storage.listing(tmp_path / "missing") == [] and storage.sizes(tmp_path / "missing") == {}
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(tmp_path / "v" / "nothing.json")


@pytest.mark.parametrize("exc, says", [
    (PermissionError("Access Denied"), "access denied to bucket 'data-bucket', key 'sets/t/v1/manifest.json'"),
    (OSError("An error occurred (AccessDenied) when calling GetObject"), "access denied to bucket 'data-bucket'"),
    (FileNotFoundError("The specified bucket does not exist"), "bucket 'data-bucket' does not exist (key 'sets/t/"),
])
def test_a_missing_bucket_or_a_denied_request_is_a_user_error_naming_bucket_and_key(exc, says):
    error = storage.storage_error("s3://data-bucket/sets/t/v1/manifest.json", exc, "reading")
    assert isinstance(error, ConfigError) and says in str(error)
    assert str(error).startswith("reading s3://data-bucket/sets/t/v1/manifest.json: ")


def test_a_missing_key_and_an_unreachable_store_stay_what_they_are():
    for exc in (FileNotFoundError("data-bucket/sets/t/v1/manifest.json"), ConnectionError("refused")):
        assert storage.storage_error("s3://data-bucket/sets/t/v1/manifest.json", exc, "reading") is exc
    local = PermissionError("denied")
    assert storage.storage_error("/var/data/x", local, "reading") is local
