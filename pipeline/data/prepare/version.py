"""Writing one dataset version: input -> validated, versioned MDS dataset, converted in parallel, published atomically.

One pass over the input. The input is cut into units (Parquet row groups, IDX row ranges, runs of
image files, whole CSV/JSON Lines files) and a plan of every column's role and encoding is made from
its first rows (``schema``); worker processes convert units independently (``convert``): each reads
its unit in record batches, validates every row (``rows``), assigns splits by a hash of the key,
encodes the batch with numpy and writes its own ``SPLIT/part-NNNNN/`` MDS sub-dataset, and returns
mergeable statistics. The parent merges the part indexes into one ``SPLIT/index.json`` per split, the
statistics into ``preprocessing.json``, writes the manifest last, and renames the temporary folder
into place (``publish``). Raw values are stored (categories as text, labels as they came), so
versions of different intervals can be read together with the statistics of the whole window.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from pipeline import storage
from pipeline.config import DataConfig
from pipeline.data.prepare import convert, idx, publish, publish_remote, sources
from pipeline.data.prepare import transform as row_transform
from pipeline.data.prepare.schema import infer_plan
from pipeline.diskspace import space_checked

log = logging.getLogger(__name__)


def prepare(cfg: DataConfig, *, name: str, out_root: Path | str, interval: tuple[str, str] | None = None) -> dict[str, Any]:
    """Publish the dataset version of ``cfg`` (and of ``interval``'s partitions) under
    ``out_root/name/VERSION`` (a folder, or an object-store URI: ``publish_remote``) and return its manifest, with
    ``skipped: true`` when it already was."""
    started = time.perf_counter()
    inp = sources.open_input(cfg.input_path, cfg.format)
    if interval:
        inp = sources.select_interval(inp, cfg.partition_key, *interval)
    described = [publish.describe(f) for f in inp.files]
    transform = row_transform.load(cfg)
    timings = {"digest": time.perf_counter() - started}
    version = publish.content_version(described, cfg, inp.fmt, interval,
                                      transform_files=row_transform.files_digest(transform) if transform else None)
    if storage.is_remote(out_root):
        final = storage.join(out_root, name, version)
        with publish_remote.writing(final, publish.reusable) as (lease, published):
            if lease is None:
                return _skipped(name, version, final, published)
            staged = publish_remote.staging_folder(name, version)
            try:
                manifest = _write(cfg, inp, transform, name, version, final, staged, described, interval, started,
                                  timings)
                publish_remote.upload(staged, final, lease)
            finally:
                publish_remote.discard(staged)
    else:
        final = Path(out_root) / name / version
        published = publish.reusable(final)
        if published is not None:
            return _skipped(name, version, final, published)
        tmp = publish.temporary_folder(final)
        try:
            manifest = _write(cfg, inp, transform, name, version, final.as_uri(), tmp, described, interval, started,
                              timings)
            publish.publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("published dataset %s version %s: rows %s, %d bad row(s), %.1f s, %d worker(s)", name, version,
             manifest["splits"], manifest["bad_rows"]["count"], manifest["prep_wall_s"], manifest["workers"])
    return {**manifest, "skipped": False}


def _skipped(name: str, version: str, final, published: dict[str, Any]) -> dict[str, Any]:
    log.info("dataset %s version %s already published at %s, its files intact: skipping", name, version, final)
    return {**published, "skipped": True}


def _write(cfg: DataConfig, inp, transform, name: str, version: str, uri: str, tmp: Path, described, interval,
           started: float, timings: dict[str, float]) -> dict[str, Any]:
    """Convert the input into the version's files in ``tmp``, the manifest (naming ``uri``) last."""
    units = sources.plan_units(inp, unit_bytes=cfg.unit_bytes)
    plan = infer_plan(inp, units, cfg, transform)
    workers = convert.plan_workers(units, inp.fmt, cfg.workers)
    with space_checked(tmp, None):  # shards name the bytes they needed; the other writes are small
        if inp.fmt == "idx":
            units = idx.stage(units, tmp / "_staged")
        timings["plan"] = time.perf_counter() - started - timings["digest"]
        results = convert.convert(plan, units, tmp, workers=workers)
        timings["convert"] = time.perf_counter() - started - timings["digest"] - timings["plan"]
        shutil.rmtree(tmp / "_staged", ignore_errors=True)
        if transform:
            row_transform.copy_files(transform, tmp)
        return publish.assemble(cfg, plan, name, version, uri, tmp, described, results, interval, started, timings,
                                workers=workers)
