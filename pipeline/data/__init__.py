"""Data preparation: raw sources -> validated, versioned MDS datasets with a manifest."""


def local_path(uri: str):
    """The local folder behind a dataset URI (``file://...``) or plain path."""
    from pathlib import Path

    return Path(uri.removeprefix("file://"))


def dataset_uris(dataset: dict) -> list[str]:
    """The version URIs a stage's dataset summary stands for: a window's, or the one version's."""
    return list(dataset.get("uris") or [dataset["uri"]])
