"""Data, by what it does: writing a version from raw sources (``prepare``: validated, versioned MDS datasets with a
manifest), published versions and their checks (``versions``), and reading them for training (``read``); beside
them image decoding (``images``), the demo's synthetic inputs (``demo``) and real data sets that system packages
ship (``packaged``)."""

from __future__ import annotations

from pathlib import Path


def local_path(uri: str) -> Path:
    """The local path behind a ``file:`` URI (``file:///p``, ``file://localhost/p``, ``file:/p``, with
    its percent-escapes decoded: ``Path.as_uri`` writes a space as ``%20``), or a plain path as is."""
    from urllib.parse import unquote, urlsplit

    from pipeline.errors import DataError

    if not uri.startswith("file:"):
        return Path(uri)
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise DataError(f"{uri}: a file URI of host {parts.netloc!r}; expected a local one (file:///PATH)")
    return Path(unquote(parts.path))


def version_location(uri: str) -> Path | str:
    """Where a published version's files are read: the local path of a ``file:`` URI or a path, or the object-store
    URI as it is (``pipeline.storage``)."""
    from pipeline import storage

    return str(uri).rstrip("/") if storage.is_remote(uri) else local_path(str(uri))



def open_uri(uri: str, compression: str | None = "infer"):
    """A binary file object for reading a path or fsspec URI (gzip and other compressions undone unless
    ``compression`` is None)."""
    import fsspec

    return fsspec.open(uri, "rb", compression=compression).open()
