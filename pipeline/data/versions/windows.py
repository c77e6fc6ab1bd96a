"""Dataset versions by data interval: the asset-event metadata of a published version, and the window of
recent intervals that a training run triggered by those events reads, each checked before it is reused.
Light at import: standard library only."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

from pipeline.errors import DataError
from pipeline.results import Interval, PreparedData

log = logging.getLogger(__name__)

WRITERS_WAIT_S = 600  # how long a triggered run waits for versions of its dataset being written beside it


def summary(manifest: dict[str, Any], wall_s: float) -> PreparedData:
    """What prepare_data returns for one published version."""
    interval = manifest.get("interval")
    return PreparedData(
        name=manifest["name"], uri=manifest["uri"], version=manifest["version"], uris=(manifest["uri"],),
        versions=(manifest["version"],), rows=manifest["splits"], bad_rows=manifest["bad_rows"]["count"],
        interval=Interval(start=interval["start"], end=interval["end"]) if interval else None,
        skipped=manifest["skipped"], wall_s=wall_s,
    )


def asset_extra(prepared: PreparedData | Mapping[str, Any]) -> dict[str, Any]:
    """Asset-event metadata of a prepared dataset (or of prepare_data's XCom value, what a task body holds):
    enough for a consumer to find and judge it."""
    if not isinstance(prepared, PreparedData):
        prepared = PreparedData.from_xcom(prepared)
    interval = prepared.interval
    return {
        "dataset": prepared.name, "version": prepared.version, "uri": prepared.uri,
        "rows": prepared.rows, "bad_rows": prepared.bad_rows, "reused": prepared.skipped,
        "interval_start": interval.start if interval else None, "interval_end": interval.end if interval else None,
    }


def triggering_window(triggering_asset_events: Any, data_root: Path | str | None = None) -> dict[str, str] | None:
    """``{"dataset", "end"}`` of the newest interval among a run's triggering asset events, or None
    for a run that no asset event triggered (a manual or scheduled one).

    With ``data_root``, a version of that dataset published with a newer interval counts too: events
    that arrive together (a backfill's concurrent days) can be split between a run being created and
    none at all, so the newest day would never be trained on; a triggered run reads the newest days.
    And versions still being written beside the triggering one (a backfill's other days, a scheduled
    day's) are waited for, up to ``WRITERS_WAIT_S``: the run created at the first day's event would
    otherwise train on a window without the days that finish a second later."""
    newest = None
    for events in (triggering_asset_events or {}).values():
        for event in events:
            extra = getattr(event, "extra", None) or {}
            if extra.get("dataset") and extra.get("interval_end"):
                if newest is None or extra["interval_end"] > newest["end"]:
                    newest = {"dataset": extra["dataset"], "end": extra["interval_end"]}
    if newest is not None and data_root is not None:
        from pipeline import storage
        from pipeline.data.prepare import publish, publish_remote

        dataset_dir = storage.join(data_root, newest["dataset"])
        if storage.is_remote(dataset_dir):
            still = publish_remote.wait_for_writers(dataset_dir, WRITERS_WAIT_S)
        else:
            still = [p.name for p in publish.wait_for_writers(Path(dataset_dir), WRITERS_WAIT_S)]
        if still:
            log.warning("versions of %s still being written after %ss, read without them: %s", newest["dataset"],
                        WRITERS_WAIT_S, still)
        ends = [m["interval"]["end"] for m in published(dataset_dir) if m.get("interval")]
        newest["end"] = max([newest["end"], *ends])
    return newest


def published(root: Path | str) -> list[dict[str, Any]]:
    """Manifests of the complete versions under ``root``, a folder or an object-store URI (temporary folders and
    versions being uploaded have none)."""
    from pipeline import storage

    if not storage.is_remote(root):
        return [json.loads(manifest.read_text()) for manifest in sorted(Path(root).glob("*/manifest.json"))
                if not manifest.parent.name.startswith(".")]
    out = []
    for name in storage.listing(root):
        if not name.startswith("."):
            try:
                out.append(storage.read_json(storage.join(root, name, "manifest.json")))
            except FileNotFoundError:
                continue
    return out


def _intact(manifest: dict[str, Any]) -> dict[str, Any]:
    """A version of the window checked before it is reused; a damaged one is published again from its source
    (or the error says why it cannot be)."""
    from pipeline.data import version_location
    from pipeline.data.prepare.republish import republish
    from pipeline.data.versions import integrity

    dataset_dir = version_location(manifest["uri"])
    if not integrity.check_version(dataset_dir, manifest):
        return manifest
    return {k: v for k, v in republish(dataset_dir).items() if k != "skipped"}


def resolve(out_root: Path | str, name: str, end: str, intervals: int) -> PreparedData:
    """The newest ``intervals`` interval versions of dataset ``name`` ending by ``end``, oldest first.

    An interval prepared more than once (its input changed) counts once, with its newest version.
    """
    newest: dict[str, dict[str, Any]] = {}
    from pipeline import storage

    for m in published(storage.join(out_root, name)):
        interval = m.get("interval")
        if not interval or interval["end"] > end:
            continue
        key = interval["start"]
        if key not in newest or m["created_at"] > newest[key]["created_at"]:
            newest[key] = m
    chosen = [newest[k] for k in sorted(newest)][-intervals:]
    if not chosen:
        raise DataError(f"{storage.join(out_root, name)}: no published interval version ending by {end}")
    chosen = [_intact(m) for m in chosen]
    rows = {split: sum(m["splits"][split] for m in chosen) for split in chosen[-1]["splits"]}
    return PreparedData(
        name=name, uri=chosen[-1]["uri"], version=chosen[-1]["version"], uris=tuple(m["uri"] for m in chosen),
        versions=tuple(m["version"] for m in chosen), rows=rows, bad_rows=sum(m["bad_rows"]["count"] for m in chosen),
        interval=Interval(start=chosen[0]["interval"]["start"], end=chosen[-1]["interval"]["end"]),
        skipped=True, wall_s=0.0,
    )
