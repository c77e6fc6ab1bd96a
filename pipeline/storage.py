"""Where published files live: a local folder or an object-store prefix (``s3://bucket/prefix``), read and written
through fsspec (s3fs for S3). A location is a string: an absolute path, or a URI with a scheme.

The endpoint and the credentials are the standard AWS ones, read by every client the pipeline uses (s3fs, boto3
under streaming's downloader, pyarrow, MLflow's artifact store): ``AWS_ENDPOINT_URL`` for a server that is not
AWS (MinIO, moto), ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (or a profile, or an instance role),
``AWS_DEFAULT_REGION``. Nothing here logs them.

A missing bucket, a missing object where one must be, or a denied request is the user's to fix (``ConfigError``
naming the bucket and the key; never retried); a server that cannot be reached is an infrastructure fault.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

from pipeline.errors import ConfigError

log = logging.getLogger(__name__)

REMOTE_SCHEMES = ("s3", "gs", "gcs", "az", "abfs")  # object stores: no rename, no shared mount


def is_remote(location: str | Path) -> bool:
    """Whether ``location`` is on an object store (a URI of one of ``REMOTE_SCHEMES``)."""
    scheme, sep, _ = str(location).partition("://")
    return bool(sep) and scheme in REMOTE_SCHEMES


def join(location: str | Path, *parts: str) -> str:
    """``location`` with ``parts`` appended: ``/`` for a URI and for a path alike."""
    return "/".join([str(location).rstrip("/"), *(str(p).strip("/") for p in parts)])


def filesystem(location: str | Path):
    """The fsspec file system of ``location`` and the path within it (``fsspec.core.url_to_fs``). S3 listings
    are not cached: a version another process publishes is seen at once."""
    import fsspec

    location = str(location)
    options = {}
    if location.startswith("s3://"):
        # The endpoint in the options keys fsspec's cache of file systems: a process that moves to another endpoint
        # (AWS_ENDPOINT_URL changed) gets a file system of its own, not the one of the old endpoint.
        options = {"use_listings_cache": False, "endpoint_url": os.environ.get("AWS_ENDPOINT_URL") or None}
    return fsspec.core.url_to_fs(location, **options)


def bucket_and_key(uri: str) -> tuple[str, str]:
    _, _, rest = str(uri).partition("://")
    bucket, _, key = rest.partition("/")
    return bucket, key


def storage_error(uri: str, exc: BaseException, doing: str) -> Exception:
    """The error to raise for ``exc`` on ``uri``: a ``ConfigError`` naming the bucket and key when the store says
    the bucket is missing or the request is denied, else ``exc`` itself (a fault worth a retry)."""
    if not is_remote(uri):
        return exc
    bucket, key = bucket_and_key(uri)
    text = str(exc)
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return ConfigError(f"{doing} {uri}: access denied to bucket {bucket!r}, key {key!r}; expected credentials "
                           f"(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile or a role) allowed to read and "
                           f"write s3://{bucket}/{key.split('/')[0]}")
    if isinstance(exc, FileNotFoundError) and ("NoSuchBucket" in text or "bucket does not exist" in text):
        return ConfigError(f"{doing} {uri}: bucket {bucket!r} does not exist (key {key!r}); expected an existing "
                           f"bucket (create it, or set the location to one that exists)")
    return exc


def _raise_for(location: str | Path, exc: BaseException, doing: str) -> None:
    """Raise ``storage_error``'s error for ``exc``: the user's own, or ``exc`` as it is."""
    error = storage_error(str(location), exc, doing)
    if error is exc:
        raise exc
    raise error from exc


def read_bytes(location: str | Path) -> bytes:
    """The bytes of the file at ``location`` (``FileNotFoundError`` when there is none)."""
    if not is_remote(location):
        return Path(location).read_bytes()
    fs, path = filesystem(location)
    try:
        return fs.cat_file(path)
    except (FileNotFoundError, PermissionError) as exc:
        _raise_for(location, exc, "reading")


def read_json(location: str | Path) -> Any:
    return json.loads(read_bytes(location))


def sizes(location: str | Path) -> dict[str, int]:
    """Every file under ``location`` (recursively) by its path relative to it, with its size in bytes: one listing
    request per thousand objects on S3."""
    return {path: size for path, (size, _) in stamps(location).items()}


def stamps(location: str | Path) -> dict[str, tuple[int, str]]:
    """``sizes``, each with what changes when the file is written again (its ETag on S3, else its modification
    time): (size, stamp) by relative path, one listing."""
    fs, root = filesystem(location)
    root = root.rstrip("/")
    try:
        found = fs.find(root, detail=True)
    except (FileNotFoundError, PermissionError) as exc:
        error = storage_error(str(location), exc, "listing")
        if error is exc and isinstance(exc, FileNotFoundError):
            return {}
        raise error from exc
    return {path[len(root) + 1:]: (int(info.get("size") or 0), str(info.get("ETag") or info.get("mtime") or ""))
            for path, info in found.items() if info.get("type", "file") == "file"}


def listing(location: str | Path) -> list[str]:
    """The names directly under ``location`` (files and folders; none when it does not exist)."""
    fs, root = filesystem(location)
    try:
        return sorted(Path(p.rstrip("/")).name for p in fs.ls(root.rstrip("/"), detail=False))
    except FileNotFoundError as exc:
        error = storage_error(str(location), exc, "listing")
        if error is exc:
            return []
        raise error from exc


def write_bytes(location: str | Path, data: bytes, *, create: bool = False) -> bool:
    """Write ``data`` to ``location``. With ``create``, only where nothing is yet (an S3 conditional put,
    ``If-None-Match: *``): returns False, writing nothing, when an object is already there."""
    fs, path = filesystem(location)
    try:
        fs.pipe_file(path, data, **({"mode": "create"} if create else {}))
    except FileExistsError:
        if create:
            return False
        raise
    except (FileNotFoundError, PermissionError) as exc:
        _raise_for(location, exc, "writing")
    return True


def upload(local: Path, location: str, *, last: str | None = None,
           before_last: Callable[[], None] | None = None) -> None:
    """Copy the folder ``local`` to ``location``; with ``last`` (a file relative to ``local``), that file after every
    other has landed (and ``before_last()`` has not raised): readers that look for ``last`` never see a partial copy."""
    fs, root = filesystem(location)
    root = root.rstrip("/")
    files = sorted(p for p in Path(local).rglob("*") if p.is_file())
    rest = [p for p in files if p.relative_to(local).as_posix() != last]
    try:
        if rest:
            fs.put([str(p) for p in rest], [f"{root}/{p.relative_to(local).as_posix()}" for p in rest])
        if before_last is not None:
            before_last()
        if last is not None:
            fs.put_file(str(Path(local) / last), f"{root}/{last}")
    except (FileNotFoundError, PermissionError) as exc:
        raise storage_error(location, exc, "uploading to") from exc


def upload_file(local: Path, location: str) -> None:
    """Copy the file ``local`` to ``location`` (replacing what is there), streamed from disk."""
    fs, path = filesystem(location)
    try:
        fs.put_file(str(local), path)
    except (FileNotFoundError, PermissionError) as exc:
        _raise_for(location, exc, "uploading to")


def download_file(location: str, local: Path) -> None:
    """Copy the file at ``location`` to ``local``, replaced whole: written beside it, then renamed."""
    fs, path = filesystem(location)
    local = Path(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.download")
    try:
        fs.get_file(path, str(tmp))
        os.replace(tmp, local)
    except PermissionError as exc:
        _raise_for(location, exc, "downloading")
    finally:
        tmp.unlink(missing_ok=True)


def download(location: str, local: Path) -> None:
    """Copy every file under ``location`` into the folder ``local`` (made if missing), keeping their relative paths."""
    fs, root = filesystem(location)
    root = root.rstrip("/")
    try:
        found = fs.find(root)
        for path in found:
            target = Path(local) / path[len(root) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(target))
    except (FileNotFoundError, PermissionError) as exc:
        _raise_for(location, exc, "downloading")


def patiently(action: Callable[[], Any], *, doing: str, patience_s: float, emit: Callable[[str], None] = print) -> Any:
    """``action()``, tried again while the store cannot be reached (a connection refused or timed out, a server
    error), waiting 1 s, then twice as long each time up to 30 s, until ``patience_s`` have passed since the first
    failure; then its last fault is raised (an infrastructure fault: the attempt is retried). A user's error
    (``ConfigError``: a missing bucket, a denied request) or a missing file is raised at once."""
    import time

    first_failure, wait = None, 1.0
    while True:
        try:
            return action()
        except (ConfigError, FileNotFoundError, PermissionError, FileExistsError):
            raise
        except Exception as exc:  # noqa: BLE001 - s3fs, botocore and aiohttp each raise their own for a lost server
            now = time.monotonic()
            first_failure = first_failure or now
            if now - first_failure + wait > patience_s:
                raise
            emit(f"WARNING: {doing}: the store did not answer ({type(exc).__name__}: {exc}); trying again in "
                 f"{wait:.0f} s ({now - first_failure:.0f} s of {patience_s:.0f} s spent)")
            time.sleep(wait)
            wait = min(wait * 2, 30.0)


def remove(location: str | Path) -> None:
    """Delete ``location`` and everything under it (nothing when there is none)."""
    fs, path = filesystem(location)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError as exc:  # nothing to remove, unless it is the bucket that is missing
        error = storage_error(str(location), exc, "removing")
        if error is not exc:
            raise error from exc
    except PermissionError as exc:
        _raise_for(location, exc, "removing")


def modified_age_s(location: str | Path) -> float | None:
    """Seconds since the object at ``location`` was last written (by the store's clock against this host's),
    or None when there is none."""
    import time

    fs, path = filesystem(location)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        _raise_for(location, exc, "reading")
    modified = info.get("LastModified") or info.get("mtime") or info.get("created")
    stamp = modified.timestamp() if hasattr(modified, "timestamp") else float(modified or 0)
    return time.time() - stamp
