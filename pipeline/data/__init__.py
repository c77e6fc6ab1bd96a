"""Data preparation: raw sources -> validated, versioned MDS datasets with a manifest."""


def local_path(uri: str):
    """The local folder behind a dataset URI (``file://...``) or plain path."""
    from pathlib import Path

    return Path(uri.removeprefix("file://"))
