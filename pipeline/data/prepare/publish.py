"""Publishing a dataset version: the content digest that names it, the manifest and statistics that describe
it, and the atomic rename that publishes it (reading them back: ``pipeline.data.versions.manifest``).

A version is written to ``NAME/.tmp-VERSION-HOST-PID-NONCE/`` and renamed to ``NAME/VERSION/`` after
its ``manifest.json``, written last, marks it complete; readers only look at folders with a manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipeline import storage
from pipeline.config import DataConfig
from pipeline.config_fields import WHAT, identity_of, only
from pipeline.data.prepare import mds_writer, splits
from pipeline.data.prepare.plan import Plan, SourceFile
from pipeline.data.prepare.rows import BAD_EXAMPLES
from pipeline.data.versions import integrity
from pipeline.data.versions.manifest import (
    MANIFEST,
    PREPROCESSING,
    STATS,
    read_manifest,
)
from pipeline.data.versions.stats import Stats
from pipeline.errors import DataError
from pipeline.process_table import alive

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
QUARANTINE = "quarantine.parquet"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 24 * 3600  # a temporary folder this old is a dead writer's, whatever host it was on


def _temporaries(parent: Path) -> list[tuple[Path, bool]]:
    """The temporary folders under ``parent``, each with whether its writer is gone: its process is gone
    from this host, or the folder is older than a day (its writer was on another host)."""
    host = socket.gethostname()
    found = []
    for path in Path(parent).glob(f"{TMP_PREFIX}*"):
        try:
            _, _, tail = path.name.removeprefix(TMP_PREFIX).partition("-")  # version-host-pid-nonce
            writer_host, pid, _ = tail.rsplit("-", 2)
            age_s = time.time() - path.stat().st_mtime
        except (ValueError, OSError):
            continue
        found.append((path, (writer_host == host and not alive(int(pid))) or age_s > STALE_TMP_S))
    return found


def remove_stale_temporaries(parent: Path) -> None:
    """Delete temporary folders of writers that died (killed, crashed host): readers never look at
    them, but they hold disk."""
    for path, gone in _temporaries(parent):
        if gone:
            log.info("removing %s, left by a writer that is gone", path)
            shutil.rmtree(path, ignore_errors=True)


def wait_for_writers(parent: Path, timeout_s: float, poll_s: float = 1.0) -> list[Path]:
    """Wait, at most ``timeout_s``, while versions of the dataset ``parent`` are being written (by live
    writers); returns the temporary folders still being written when the wait ended."""
    deadline = time.monotonic() + timeout_s
    waited = False
    while True:
        writing = [path for path, gone in _temporaries(parent) if not gone]
        if not writing or time.monotonic() >= deadline:
            return writing
        if not waited:
            log.info("waiting up to %.0fs for %d version(s) of %s being written: %s", timeout_s, len(writing),
                     parent.name, [p.name for p in writing])
            waited = True
        time.sleep(poll_s)


def temporary_folder(final: Path) -> Path:
    """A new, empty folder beside ``final`` to write the version into; its name says whose it is."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final.parent)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def publish(tmp: Path, final: Path) -> None:
    """Rename the complete version into place; a copy another writer published first is kept."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / MANIFEST).exists():
            raise
        log.info("version %s was published concurrently; keeping that copy", final.name)
        shutil.rmtree(tmp, ignore_errors=True)


def reusable(final: Path | str) -> dict[str, Any] | None:
    """The manifest of the version published at ``final`` (a folder or an object-store URI) when its files are
    intact, else None: a damaged version (a file or the manifest itself not what was published) is moved aside to
    be published again."""
    try:
        manifest = read_manifest(final)
    except FileNotFoundError:
        return None
    except ValueError:  # the manifest itself is damaged
        log.warning("%s is not readable JSON: moving the version aside to publish it again",
                    storage.join(final, MANIFEST))
        integrity.move_aside(final)
        return None
    return None if integrity.set_aside_if_damaged(final, manifest) else manifest


def describe(f: SourceFile) -> dict[str, Any]:
    import fsspec

    digest = hashlib.sha256()
    for uri in filter(None, (f.uri, f.partner)):
        with fsspec.open(uri, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return {"path": f.uri, "relpath": f.relpath, "bytes": f.size, "sha256": digest.hexdigest()}


def content_version(described: list[dict[str, Any]], cfg: DataConfig, fmt: str, interval: tuple[str, str] | None,
                    transform_files: list[list[str]] | None = None) -> str:
    """Content digest of the inputs (bytes and names: names key the splits) and of every setting declared to
    change the output (``what_field``), a row transform's files included. Where the input lies, worker count and
    batch size are ``where_field``s: the output is the same for any."""
    relevant = only(asdict(cfg), identity_of(type(cfg)), WHAT)
    if not relevant.get("transform"):
        relevant.pop("transform", None)  # versions made before row transforms keep their digest
    content = {
        "format_version": FORMAT_VERSION, "input_format": fmt, "config": relevant,
        "interval": list(interval) if interval else None,
        "inputs": [[d["relpath"], d["sha256"]] for d in described],
    }
    if transform_files is not None:
        content["transform_files"] = transform_files
    blob = json.dumps(content, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def assemble(cfg: DataConfig, plan: Plan, name: str, version: str, uri: str, tmp: Path,
             described: list[dict[str, Any]], results: list[dict[str, Any]], interval, started: float,
             timings: dict[str, float], *, workers: int) -> dict[str, Any]:
    """Merge the workers' parts, statistics and quarantines; check the whole; write the manifest last."""
    read = sum(r["read"] for r in results)
    bad = sum(r["bad"] for r in results)
    if read == 0:
        raise DataError(f"{cfg.input_path}: the input has no rows")
    if bad:
        examples = [e for r in results for e in r["bad_examples"]][:BAD_EXAMPLES]
        log.warning("%d of %d rows are bad and quarantined; first: %s", bad, read, "; ".join(examples))
        if bad / read > cfg.max_bad_fraction:
            raise DataError(
                f"{cfg.input_path}: {bad} of {read} rows ({bad / read:.2%}) are bad, more than "
                f"data.max_bad_fraction={cfg.max_bad_fraction}; first: {'; '.join(examples)}"
            )
    stats = Stats(plan.numeric_columns, plan.categorical_columns, plan.label_kind)
    for r in results:
        stats.merge(Stats.from_dict(r["stats"]))
    prep = stats.preprocessing(plan.declared_classes)
    if plan.label_column and len(prep["label_classes"]) < 2:
        raise DataError(
            f"{cfg.input_path}: label column {plan.label_column!r} has {len(prep['label_classes'])} distinct "
            f"value(s) {prep['label_classes']}; expected at least 2 classes"
        )
    rows = {s: sum(r["rows"][s] for r in results) for s in splits.SPLITS}
    if rows["train"] == 0 or rows["test"] == 0:
        raise DataError(
            f"{cfg.input_path}: splits came out with rows {rows}; the train and test splits need at least "
            f"one row each (more input rows or other split fractions)"
        )
    shards, indexes = {}, {}
    for split in splits.SPLITS:
        # The file each shard is stored as (compressed or not), with its size and digest: what readers check.
        shards[split] = [{"basename": stored["basename"], "samples": s["samples"], "bytes": stored["bytes"],
                          **stored["hashes"]}
                         for s in mds_writer.merge_parts(tmp / split) for stored in [s["zip_data"] or s["raw_data"]]]
        indexes[split] = integrity.file_entry((tmp / split / integrity.INDEX).read_bytes(), integrity.INDEX)
    quarantine = None
    if bad:
        quarantine = _merge_quarantine(tmp)
    sample_rows = next((r["sample_rows"] for r in results if r["sample_rows"]), [])
    _write_json(tmp / STATS, stats.to_dict())
    _write_json(tmp / PREPROCESSING, prep)
    manifest = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "version": version,
        "uri": uri,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "interval": {"start": interval[0], "end": interval[1]} if interval else None,
        "sources": described,
        "config": asdict(cfg),
        "config_class": f"{type(cfg).__module__}:{type(cfg).__qualname__}",  # what republishing rebuilds it with
        "schema": plan.schema(),
        "label_classes": prep["label_classes"],
        "splits": rows,
        "shards": shards,
        "indexes": indexes,
        "bad_rows": {"count": bad, "read": read, "fraction": round(bad / read, 6), "policy": plan.on_bad_rows,
                     "quarantine": QUARANTINE if quarantine else None},
        "sample_rows": sample_rows,
        **({"time_split": plan.time_split.describe()} if plan.time_split is not None else {}),
        **({"file_split": plan.file_split.describe()} if plan.file_split is not None else {}),
        **({"transform": _sum_counts(results)} if plan.transform is not None else {}),
        "workers": workers,  # the processes that converted, this one included
        "units": len(results),
        "prep_wall_s": round(time.perf_counter() - started, 3),
    }
    # Where the time went: hashing the inputs, planning (and staging IDX), converting, merging.
    timings["merge"] = manifest["prep_wall_s"] - sum(timings.values())
    manifest["timings_s"] = {k: round(v, 3) for k, v in timings.items()}
    _write_json(tmp / MANIFEST, manifest)  # written last: its presence marks a complete version
    return manifest


def _sum_counts(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The row transform's counts of every unit, added up (rows in, rows out, dropped, ...)."""
    from collections import Counter

    total: Counter = Counter()
    for r in results:
        total.update(r.get("transform_counts", {}))
    return dict(sorted(total.items()))


def _merge_quarantine(tmp: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = sorted((tmp / "_quarantine").glob("part-*.parquet"))
    table = pa.concat_tables([pq.read_table(p) for p in parts], promote_options="permissive")
    pq.write_table(table, tmp / QUARANTINE)
    shutil.rmtree(tmp / "_quarantine")
    return tmp / QUARANTINE


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, default=str))
