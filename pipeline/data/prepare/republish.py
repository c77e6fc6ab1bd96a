"""Publish a damaged dataset version again from its source: ``python -m pipeline.data.prepare.republish DIR``.

The version's manifest records the data config, the data interval and the sources it was made from;
preparing that again gives the same version when the sources are unchanged, and ``prepare`` sets the
damaged copy aside (``integrity``) before it writes the new one. When the sources are gone or changed,
the damaged copy stays where it is and the error says why it cannot be rebuilt.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from typing import Any

from pipeline.config import DataConfig
from pipeline.config_fields import build
from pipeline.data.prepare.publish import read_manifest
from pipeline.data.versions import integrity
from pipeline.errors import ConfigError, DataError, UserError

log = logging.getLogger(__name__)


def data_config(manifest: dict[str, Any]) -> DataConfig:
    """The data config a version was prepared with (a recipe's subclass where it had one)."""
    module, _, name = manifest.get("config_class", "pipeline.config:DataConfig").partition(":")
    if not module.startswith("pipeline."):
        raise ConfigError(f"config_class {manifest['config_class']!r}: expected a class of this project")
    cls = getattr(importlib.import_module(module), name)
    return build(cls, manifest["config"], prefix="data.")


def republish(dataset_dir: Path | str) -> dict[str, Any]:
    """Check the version at ``dataset_dir`` (a folder or an object-store URI); when damaged, publish it again from
    its source. Returns the version's manifest (``skipped`` when it was intact)."""
    from pipeline import storage
    from pipeline.data.prepare.version import prepare

    if storage.is_remote(dataset_dir):
        dataset_dir = str(dataset_dir).rstrip("/")
        out_root = dataset_dir.rsplit("/", 2)[0]
    else:
        dataset_dir = Path(dataset_dir).resolve()
        out_root = dataset_dir.parent.parent
    try:
        manifest = read_manifest(dataset_dir)
    except FileNotFoundError:
        raise DataError(f"{dataset_dir}: no published dataset version here (no manifest.json)") from None
    damage = integrity.check_version(dataset_dir, manifest)
    if not damage:
        return {**manifest, "skipped": True}
    log.warning("%s: publishing it again from its source", integrity.describe_damage(dataset_dir, manifest, damage))
    interval = manifest.get("interval")
    try:
        made = prepare(data_config(manifest), name=manifest["name"], out_root=out_root,
                       interval=(interval["start"], interval["end"]) if interval else None)
    except UserError as exc:
        raise DataError(f"{dataset_dir} cannot be published again from its source: {exc}. Restore the version's "
                        f"folder from a backup, or prepare the data anew") from exc
    if made["version"] != manifest["version"]:
        raise DataError(
            f"{dataset_dir} cannot be published again from its source: the source has changed since and now "
            f"gives version {made['version']} (published at {made['uri']}). Restore version "
            f"{manifest['version']} from a backup, or read version {made['version']} instead")
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.data.prepare.republish", description=__doc__.splitlines()[0])
    parser.add_argument("dataset_dir", help="the version's folder or URI: DATA_DIR/NAME/VERSION")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        manifest = republish(args.dataset_dir)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.dataset_dir}: " + ("intact, nothing to do" if manifest["skipped"] else "published again"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
