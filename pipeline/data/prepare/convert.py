"""Conversion: work units -> MDS parts, in this process and a pool of workers, with their statistics.

Each unit is read in record batches; every batch is validated, split by a hash of its keys, encoded
with numpy and written to the unit's own ``SPLIT/part-NNNNN/``, so the output does not depend on which
process converted which unit, nor on how many there were.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.prepare import mds_writer, sources, splits
from pipeline.data.prepare import transform as row_transform
from pipeline.data.prepare.plan import Plan, Unit, key_hashes
from pipeline.data.prepare.rows import BAD_EXAMPLES, conform, quarantine_rows
from pipeline.data.prepare.schema import check_columns
from pipeline.data.versions.stats import Stats
from pipeline.errors import DataError
from pipeline.process_table import alive

log = logging.getLogger(__name__)

_SAMPLE_ROWS = 5

# Starting the pool is not free: the forkserver starts an interpreter and imports what workers use
# (numpy, pyarrow, fsspec, ...) before the first unit reaches a worker, 0.5 to 0.8 s on a 2-core
# machine, on a core the preparing process could use.
WORKER_START_S = 0.6
# What one process converts per second, in input bytes as ``Unit.size_bytes`` counts them, measured
# on a 2-core machine under load: reading, validation, splits, encoding, compression and hashing
# together. CSV values are parsed from text; images in folders are small compressed files that each
# need a decode, so their bytes go slowest.
CONVERT_BYTES_PER_S = {"parquet": 40e6, "csv": 12e6, "jsonl": 40e6, "idx": 55e6, "image_folder": 4e6}
# Two processes convert about 1.3x as fast as one, not 2x (the work is memory-bound: every byte is
# copied a few times by encoding, compression and hashing, and the cores are shared), so a worker
# pays back its start only when every process gets at least this many start costs of work.
MIN_WORK_PER_PROCESS = 2.0  # in units of WORKER_START_S


def plan_workers(units: list[Unit], fmt: str, requested: int) -> int:
    """How many processes (this one included, at most ``requested``) to convert ``units`` with: as
    many as the planned work keeps busy for ``MIN_WORK_PER_PROCESS`` start costs each, so that a
    small job runs in this process alone and a big one uses the pool."""
    work_s = sum(u.size_bytes for u in units) / CONVERT_BYTES_PER_S.get(fmt, min(CONVERT_BYTES_PER_S.values()))
    workers = max(1, min(requested, len(units)))
    while workers > 1 and work_s < workers * MIN_WORK_PER_PROCESS * WORKER_START_S:
        workers -= 1
    if workers < requested:
        log.info("converting %d unit(s) (%.0f MiB, about %.1f s of work) with %d process(es) of data.workers=%d: "
                 "a worker takes about %.1f s to start", len(units), sum(u.size_bytes for u in units) / 2**20,
                 work_s, workers, requested, WORKER_START_S)
    return workers


def convert(plan: Plan, units: list[Unit], tmp: Path, *, workers: int) -> list[dict[str, Any]]:
    """Convert every unit with ``workers`` processes, this one included; results in unit order.

    Every process takes the next unit not yet taken, in unit order, when it is ready for one, so no
    unit waits for a worker that is still starting while this process could convert it."""
    if workers <= 1:
        return [convert_unit(plan, unit, str(tmp)) for unit in units]
    import multiprocessing

    # forkserver: workers fork from a clean server that preloaded what they import (once, not once
    # per worker), not from a task process whose threads might hold locks.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_worker_modules(plan.fmt))
    next_unit = ctx.Value("q", 0)
    with ProcessPoolExecutor(max_workers=workers - 1, mp_context=ctx, initializer=_init_worker,
                             initargs=(os.getpid(), next_unit)) as pool:
        futures = [pool.submit(_take_units, plan, units, str(tmp)) for _ in range(workers - 1)]
        try:
            outcomes = _take_units(plan, units, str(tmp), next_unit)
            for future in futures:
                outcomes.update(future.result())
        except BaseException:
            with next_unit.get_lock():
                next_unit.value = len(units)  # no process takes another unit
            raise
    # Units are taken in order and a process stops at its first bad unit, so every unit before the
    # first bad one was converted: the error reported is the same for any worker count.
    results = []
    for i in range(len(units)):
        outcome = outcomes[i]
        if isinstance(outcome, BaseException):
            raise outcome
        results.append(outcome)
    return results


_next_unit = None  # a worker's handle on the shared index of the next unit to take


def _take_units(plan: Plan, units: list[Unit], tmp: str, next_unit=None) -> dict[int, Any]:
    """Convert the next untaken unit until none is left; a bad unit ends this process's share (and
    stops the others taking more) with its DataError as its outcome."""
    next_unit = next_unit if next_unit is not None else _next_unit
    outcomes: dict[int, Any] = {}
    while True:
        with next_unit.get_lock():
            i = next_unit.value
            next_unit.value = i + 1
        if i >= len(units):
            return outcomes
        try:
            outcomes[i] = convert_unit(plan, units[i], tmp)
        except DataError as exc:
            outcomes[i] = exc
            with next_unit.get_lock():
                next_unit.value = len(units)
            return outcomes


def _worker_modules(fmt: str) -> list[str]:
    """What the forkserver imports once for every worker: what converting ``fmt`` needs (pandas only
    for CSV, whose values are parsed from text; it alone takes ~0.3 s to import)."""
    by_format = {"parquet": ["pyarrow.parquet"], "csv": ["pyarrow.csv", "pandas"], "jsonl": ["pyarrow.json"],
                 "idx": [], "image_folder": ["PIL.Image"]}
    return [__name__, "fsspec", "pyarrow.compute", "zstd", "xxhash", *by_format.get(fmt, [])]


def _init_worker(parent_pid: int, next_unit) -> None:
    """A killed preparation must not leave workers behind. A worker's parent is the forkserver, and
    the forkserver lives as long as any worker does (each holds its liveness pipe), so neither
    notices on its own that the preparing process died: a thread of each worker watches that
    process and ends the worker when it is gone (within a second; ``convert_unit`` also checks
    between batches). Each worker decodes with one Arrow thread: the processes are the
    parallelism, and Arrow's own pool (one thread per core, in every worker) would only make them
    compete."""
    import threading

    import pyarrow as pa

    global _next_unit
    _next_unit = next_unit
    pa.set_cpu_count(1)

    def watch() -> None:
        while alive(parent_pid):
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _parent_gone(plan: Plan) -> bool:
    return plan.parent_pid != os.getpid() and not alive(plan.parent_pid)


def convert_unit(plan: Plan, unit: Unit, tmp: str) -> dict[str, Any]:
    """One unit -> ``tmp/SPLIT/part-NNNNN/`` MDS parts; returns rows, statistics and bad-row counts."""
    import pyarrow as pa

    if _parent_gone(plan):
        raise SystemExit(f"the preparing process {plan.parent_pid} is gone; not starting unit {unit.index}")
    part = f"part-{unit.index:05d}"
    writers = {s: mds_writer.PartWriter(Path(tmp) / s / part, plan.encodings, compression=plan.compression,
                                 size_limit=plan.size_limit) for s in splits.SPLITS}
    stats = Stats(plan.numeric_columns, plan.categorical_columns, plan.label_kind)
    quarantined: list[pa.Table] = []
    bad_examples: list[str] = []
    read = bad = 0
    sample_rows: list[dict[str, Any]] = []
    transform_counts: Counter = Counter()
    for batch in sources.read_unit(unit, plan.fmt, batch_rows=plan.batch_rows, string_columns=plan.text_columns):
        if _parent_gone(plan):
            raise SystemExit(f"the preparing process {plan.parent_pid} is gone; stopping")
        n = batch.table.num_rows
        check_columns(batch.table.schema.names, plan.columns, batch.origins[0])
        table, problems = conform(batch, plan)
        read += n
        good = np.ones(n, bool)
        if problems:
            if plan.on_bad_rows == "fail":
                row, column, problem = problems[0]
                raise DataError(f"{batch.where(row)}, column {column!r}: {problem}")
            bad += len(problems)
            bad_examples += [f"{batch.where(r)}, column {c!r}: {p}" for r, c, p in problems[:BAD_EXAMPLES]]
            quarantined.append(quarantine_rows(batch, problems))
            good[[r for r, _, _ in problems]] = False
            table = table.filter(pa.array(good))
        keys = batch.keys[good] if problems else batch.keys
        if plan.key_column:
            keys = key_hashes(table.column(plan.key_column).to_pylist())
        if plan.time_split is not None:
            codes = plan.time_split.assign(table)
        else:
            codes = splits.assign(keys, seed=plan.split_seed, val_fraction=plan.val_fraction,
                                  test_fraction=0.0 if plan.file_split is not None else plan.test_fraction)
            if plan.file_split is not None:
                codes[plan.file_split.test_rows(batch, unit.files)[good]] = 2
        _update_stats(stats, table, codes == 0, plan)
        if plan.transform is not None:
            rows = np.flatnonzero(good) if problems else np.arange(n)
            table, codes = row_transform.apply_by_split(plan.transform, table, codes, transform_counts, batch.where, rows)
        # Rows grouped by split (stable: input order within a split), so each split's samples are one
        # contiguous run of the encoded buffer.
        order = np.argsort(codes, kind="stable")
        buf, bounds = mds_writer.encode_batch(plan.encodings, table.take(pa.array(order)))
        ends = np.cumsum(np.bincount(codes, minlength=len(splits.SPLITS)))
        for code, split in enumerate(splits.SPLITS):
            writers[split].write(buf, bounds, int(ends[code - 1]) if code else 0, int(ends[code]))
        if len(sample_rows) < _SAMPLE_ROWS:
            features = plan.numeric_columns + plan.categorical_columns
            sample_rows += table.select(features).slice(0, _SAMPLE_ROWS - len(sample_rows)).to_pylist()
    for writer in writers.values():
        writer.finish()
    if quarantined:
        import pyarrow.parquet as pq

        qdir = Path(tmp) / "_quarantine"
        qdir.mkdir(exist_ok=True)
        pq.write_table(pa.concat_tables(quarantined), qdir / f"{part}.parquet")
    return {"unit": unit.index, "read": read, "bad": bad, "bad_examples": bad_examples[:BAD_EXAMPLES],
            "rows": {s: w.rows for s, w in writers.items()}, "stats": stats.to_dict(), "sample_rows": sample_rows,
            "transform_counts": dict(transform_counts)}


def _update_stats(stats: Stats, table, is_train: np.ndarray, plan: Plan) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    train = table.filter(pa.array(is_train))
    if plan.numeric_columns:
        stats.add_numeric(np.column_stack([
            train.column(c).to_numpy().astype(np.float64) for c in plan.numeric_columns]))
    for name in plan.categorical_columns:
        for item in pc.value_counts(train.column(name)).to_pylist():
            stats.categories[name][item["values"]] += item["counts"]
    for item in (pc.value_counts(table.column(plan.label_column)).to_pylist() if plan.label_column else []):
        stats.labels[item["values"]] += item["counts"]
