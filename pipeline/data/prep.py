"""Data preparation: input -> validated, versioned MDS dataset, converted in parallel, published atomically.

One pass over the input. The input is cut into units (Parquet row groups, IDX row ranges, runs of
image files, whole CSV/JSON Lines files); worker processes convert units independently: each reads
its unit in record batches, validates every row, assigns splits by a hash of the key, encodes the
batch with numpy and writes its own ``SPLIT/part-NNNNN/`` MDS sub-dataset, and returns mergeable
statistics. The parent merges the part indexes into one ``SPLIT/index.json`` per split, the
statistics into ``preprocessing.json``, writes the manifest last, and renames the temporary folder
into place. Raw values are stored (categories as text, labels as they came), so versions of
different intervals can be read together with the statistics of the whole window.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import socket
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import DataConfig
from pipeline.data import mds, sources, splits
from pipeline.data.stats import MISSING, Stats
from pipeline.errors import ConfigError, DataError
from pipeline.processes import alive

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
PREPROCESSING = "preprocessing.json"
STATS = "stats.json"
QUARANTINE = "quarantine.parquet"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 24 * 3600  # a temporary folder this old is a dead writer's, whatever host it was on
_SAMPLE_ROWS = 5
_WORKER_MODULES = (__name__, "fsspec", "pandas", "pyarrow.compute", "pyarrow.parquet", "pyarrow.csv", "pyarrow.json",
                   "PIL.Image", "zstd", "xxhash")
_BAD_EXAMPLES = 5


@dataclass(kw_only=True)
class Plan:
    """What every worker needs: the columns' roles and encodings, and the preparation settings."""

    fmt: str
    columns: list[str]
    label_column: str
    label_kind: str  # "int" or "str"
    key_column: str
    numeric_columns: list[str]
    categorical_columns: list[str]
    image_columns: list[str]
    array_columns: list[str]
    encodings: dict[str, str]  # MDS column -> encoding; MDS columns are the input's columns
    declared_classes: list[str]
    text_columns: list[str] = field(default_factory=list)  # CSV: read as text, converted here per row
    on_bad_rows: str = "fail"
    val_fraction: float = 0.1
    test_fraction: float = 0.1
    split_seed: int = 0
    compression: str | None = "zstd"
    size_limit: int = 1 << 26
    batch_rows: int = 65_536
    parent_pid: int = 0  # workers stop when the process that started them is gone (killed)

    def schema(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k in (
            "fmt", "columns", "label_column", "label_kind", "key_column", "numeric_columns",
            "categorical_columns", "image_columns", "array_columns", "encodings")}


# --- the stage ----------------------------------------------------------------------------------

def prepare(cfg: DataConfig, *, name: str, out_root: Path, interval: tuple[str, str] | None = None) -> dict[str, Any]:
    """Publish the dataset version of ``cfg`` (and of ``interval``'s partitions) under
    ``out_root/name/VERSION`` and return its manifest, with ``skipped: true`` when it already was."""
    started = time.perf_counter()
    inp = sources.open_input(cfg.input_path, cfg.format)
    if interval:
        inp = sources.select_interval(inp, cfg.partition_key, *interval)
    described = [_describe(f) for f in inp.files]
    timings = {"digest": time.perf_counter() - started}
    version = _version(described, cfg, inp.fmt, interval)
    final = Path(out_root) / name / version
    if (final / MANIFEST).exists():
        log.info("dataset %s version %s already published at %s: skipping", name, version, final)
        return {**read_manifest(final), "skipped": True}

    units = sources.plan_units(inp, unit_bytes=cfg.unit_bytes)
    plan = infer_plan(inp, units, cfg)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final.parent)
    tmp = final.parent / f"{TMP_PREFIX}{version}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if inp.fmt == "idx":
            units = sources.stage_idx(units, tmp / "_staged")
        timings["plan"] = time.perf_counter() - started - timings["digest"]
        results = _convert(plan, units, tmp, workers=min(cfg.workers, len(units)))
        timings["convert"] = time.perf_counter() - started - timings["digest"] - timings["plan"]
        shutil.rmtree(tmp / "_staged", ignore_errors=True)
        manifest = _assemble(cfg, plan, name, version, final, tmp, described, results, interval, started, timings)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).exists():
                raise
            log.info("version %s was published concurrently; keeping that copy", version)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("published dataset %s version %s: rows %s, %d bad row(s), %.1f s, %d worker(s)", name, version,
             manifest["splits"], manifest["bad_rows"]["count"], manifest["prep_wall_s"], manifest["workers"])
    return {**manifest, "skipped": False}


def read_manifest(dataset_dir: Path) -> dict[str, Any]:
    return json.loads((Path(dataset_dir) / MANIFEST).read_text())


def read_preprocessing(dataset_dir: Path) -> dict[str, Any]:
    return json.loads((Path(dataset_dir) / PREPROCESSING).read_text())


def read_stats(dataset_dir: Path) -> Stats:
    return Stats.from_dict(json.loads((Path(dataset_dir) / STATS).read_text()))


def remove_stale_temporaries(parent: Path) -> None:
    """Delete temporary folders of writers that died (killed, crashed host): readers never look at
    them, but they hold disk. A folder is stale when its writer's process is gone from this host, or
    when it is older than a day."""
    host = socket.gethostname()
    for path in parent.glob(f"{TMP_PREFIX}*"):
        try:
            _, _, tail = path.name.removeprefix(TMP_PREFIX).partition("-")  # version-host-pid-nonce
            writer_host, pid, _ = tail.rsplit("-", 2)
            age_s = time.time() - path.stat().st_mtime
        except (ValueError, OSError):
            continue
        if (writer_host == host and not alive(int(pid))) or age_s > STALE_TMP_S:
            log.info("removing %s, left by a writer that is gone", path)
            shutil.rmtree(path, ignore_errors=True)


def _describe(f: sources.SourceFile) -> dict[str, Any]:
    import fsspec

    digest = hashlib.sha256()
    for uri in filter(None, (f.uri, f.partner)):
        with fsspec.open(uri, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return {"path": f.uri, "relpath": f.relpath, "bytes": f.size, "sha256": digest.hexdigest()}


_NOT_IN_VERSION = ("input_path", "format", "batch_rows", "workers", "max_bad_fraction", "partition_key",
                   "window_intervals")


def _version(described: list[dict[str, Any]], cfg: DataConfig, fmt: str, interval: tuple[str, str] | None) -> str:
    """Content digest of the inputs (bytes and names: names key the splits) and of every setting that
    changes the output. Worker count and batch size do not: the output is the same for any."""
    relevant = {k: v for k, v in asdict(cfg).items() if k not in _NOT_IN_VERSION}
    blob = json.dumps({
        "format_version": FORMAT_VERSION, "input_format": fmt, "config": relevant,
        "interval": list(interval) if interval else None,
        "inputs": [[d["relpath"], d["sha256"]] for d in described],
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --- schema -------------------------------------------------------------------------------------

def infer_plan(inp: sources.Input, units: list[sources.Unit], cfg: DataConfig) -> Plan:
    """Each column's role and MDS encoding, from the first rows' Arrow schema and the config."""
    import pyarrow as pa

    first = None
    for unit in units:
        first = next(iter(sources.read_unit(unit, inp.fmt, batch_rows=256)), None)
        if first is not None and first.table.num_rows:
            break
    if first is None or not first.table.num_rows:
        raise DataError(f"{cfg.input_path}: the input has no rows")
    schema, origin = first.table.schema, first.origins[0]
    names = list(schema.names)
    columns = list(cfg.columns) or names
    _check_columns(names, columns, origin)
    for role, column in (("label_column", cfg.label_column), ("key_column", cfg.key_column)):
        if column and column not in names:
            raise DataError(f"{origin}: data.{role} {column!r} is not a column; the columns are {names}")
    missing = [c for c in cfg.categorical_columns if c not in names]
    if missing:
        raise DataError(f"{origin}: data.categorical_columns {missing} are not columns; the columns are {names}")

    label_type = schema.field(cfg.label_column).type
    if pa.types.is_integer(label_type) or pa.types.is_boolean(label_type):
        label_kind = "int"
    elif pa.types.is_string(label_type) or pa.types.is_large_string(label_type) or pa.types.is_dictionary(label_type):
        label_kind = "str"
    else:
        raise DataError(f"{origin}: label column {cfg.label_column!r} has type {label_type}; expected integer or "
                        f"string class labels")

    numeric, categorical, images, arrays, encodings = [], [], [], [], {}
    for name in columns:
        kind = schema.field(name).type
        if name == cfg.label_column:
            encodings[name] = "int64" if label_kind == "int" else "str"
            continue
        if name == cfg.key_column:
            encodings[name] = "str"
            continue
        values = first.table.column(name)
        sample = next((v for v in values.to_pylist() if v is not None), None) if pa.types.is_binary(kind) else None
        if name in cfg.categorical_columns or (_is_text(kind) and not _mostly_numbers(values, inp.fmt)):
            categorical.append(name)
            encodings[name] = "str"
            continue
        if _is_text(kind):  # text numbers (CSV): the odd wrong value is a bad row, not a categorical column
            numeric.append(name)
            encodings[name] = "float64"
            continue
        try:
            encoding = mds.infer_encoding(name, kind, sample)
        except DataError:
            raise DataError(
                f"{origin}: feature column {name!r} has type {kind}; features must be numeric (integer, float, "
                f"bool), string (categorical), images or fixed-shape arrays. Drop or convert the column."
            ) from None
        if inp.fmt == "image_folder" and encoding == "bytes":
            encoding = "png"  # the first image is not PNG or JPEG: store PNG; undecodable ones are bad rows
        if encoding in mds.SCALARS:
            numeric.append(name)
        elif encoding in ("png", "jpeg") or (inp.fmt in ("idx", "image_folder") and name == "image"):
            images.append(name)
        elif encoding == "bytes":
            raise DataError(f"{origin}: column {name!r} holds binary values that are not PNG or JPEG images; "
                            f"expected images, or drop the column")
        else:
            arrays.append(name)
        encodings[name] = encoding

    for column, encoding in mds.parse_overrides(cfg.column_encodings).items():
        if column not in encodings:
            raise ConfigError(f"data.column_encodings: {column!r} is not a column; the columns are {columns}")
        if column in categorical and encoding in mds.SCALARS and column not in cfg.categorical_columns:
            categorical.remove(column)  # declared numeric: text values are parsed, wrong ones are bad rows
            numeric.append(column)
        allowed = _allowed_overrides(column, encodings[column], numeric, images, label_kind == "int" and column == cfg.label_column)
        if encoding not in allowed:
            raise ConfigError(f"data.column_encodings: column {column!r} cannot be stored as {encoding!r}; "
                              f"expected one of {allowed}")
        encodings[column] = encoding

    return Plan(
        fmt=inp.fmt, columns=columns, label_column=cfg.label_column, label_kind=label_kind, key_column=cfg.key_column,
        numeric_columns=numeric, categorical_columns=categorical, image_columns=images, array_columns=arrays,
        encodings=encodings, declared_classes=list(cfg.label_classes),
        text_columns=columns if inp.fmt == "csv" else [], on_bad_rows=cfg.on_bad_rows,
        val_fraction=cfg.val_fraction, test_fraction=cfg.test_fraction, split_seed=cfg.split_seed,
        compression=None if cfg.compression == "none" else cfg.compression, size_limit=cfg.shard_size_limit_bytes,
        batch_rows=cfg.batch_rows, parent_pid=os.getpid(),
    )


def _is_text(kind) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _mostly_numbers(values, fmt: str) -> bool:
    """Whether a text column of a text format reads as numbers (at least 90% of the first rows)."""
    import pandas as pd

    if fmt not in ("csv", "jsonl"):
        return False
    text = pd.Series(values.to_pylist()).dropna()
    return len(text) > 0 and pd.to_numeric(text, errors="coerce").notna().mean() >= 0.9


def _allowed_overrides(column: str, inferred: str, numeric: list[str], images: list[str], int_label: bool) -> list[str]:
    if column in numeric:
        return list(mds.SCALARS)
    if column in images:
        return sorted({inferred, "png", "jpeg"})
    if int_label:
        return [e for e in mds.SCALARS if e.startswith(("int", "uint"))]
    return [inferred]


def _check_columns(names: list[str], expected: list[str], origin: str) -> None:
    missing = [c for c in expected if c not in names]
    unexpected = [c for c in names if c not in expected]
    if missing or unexpected:
        problems = ([f"missing column(s) {missing}"] if missing else []) + (
            [f"unexpected column(s) {unexpected}"] if unexpected else [])
        raise DataError(f"{origin}: {' and '.join(problems)}; expected the columns {expected}")


# --- workers ------------------------------------------------------------------------------------

def _convert(plan: Plan, units: list[sources.Unit], tmp: Path, *, workers: int) -> list[dict[str, Any]]:
    """Convert every unit with ``workers`` processes, this one included; results in unit order."""
    if workers <= 1:
        return [convert_unit(plan, unit, str(tmp)) for unit in units]
    import multiprocessing

    # forkserver: workers fork from a clean server that preloaded what they import (once, not once
    # per worker), not from a task process whose threads might hold locks.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(_WORKER_MODULES))
    with ProcessPoolExecutor(max_workers=workers - 1, mp_context=ctx, initializer=_init_worker,
                             initargs=(os.getpid(),)) as pool:
        futures = [pool.submit(convert_unit, plan, unit, str(tmp)) for unit in units]
        try:
            # This process converts too, taking from the end the units no worker has started: it
            # works while the pool starts up, and the last units go to whoever is free.
            outcomes: dict[int, Any] = {}
            for i in reversed(range(len(units))):
                if futures[i].cancel():
                    try:
                        outcomes[i] = convert_unit(plan, units[i], str(tmp))
                    except DataError as exc:
                        outcomes[i] = exc
                        break
            results = []
            # In unit order, so the error reported for bad input is the same for any worker count.
            for i, future in enumerate(futures):
                outcome = outcomes[i] if i in outcomes else future.result()
                if isinstance(outcome, BaseException):
                    raise outcome
                results.append(outcome)
            return results
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _init_worker(parent_pid: int) -> None:
    """A killed preparation must not leave workers behind. A worker's parent is the forkserver, and
    the forkserver lives as long as any worker does (each holds its liveness pipe), so neither
    notices on its own that the preparing process died: a thread of each worker watches that
    process and ends the worker when it is gone (within a second; ``convert_unit`` also checks
    between batches). Each worker decodes with one Arrow thread: the processes are the
    parallelism, and Arrow's own pool (one thread per core, in every worker) would only make them
    compete."""
    import threading

    import pyarrow as pa

    pa.set_cpu_count(1)

    def watch() -> None:
        while alive(parent_pid):
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _parent_gone(plan: Plan) -> bool:
    return plan.parent_pid != os.getpid() and not alive(plan.parent_pid)


def convert_unit(plan: Plan, unit: sources.Unit, tmp: str) -> dict[str, Any]:
    """One unit -> ``tmp/SPLIT/part-NNNNN/`` MDS parts; returns rows, statistics and bad-row counts."""
    import pyarrow as pa

    if _parent_gone(plan):
        raise SystemExit(f"the preparing process {plan.parent_pid} is gone; not starting unit {unit.index}")
    part = f"part-{unit.index:05d}"
    writers = {s: mds.PartWriter(Path(tmp) / s / part, plan.encodings, compression=plan.compression,
                                 size_limit=plan.size_limit) for s in splits.SPLITS}
    stats = Stats(plan.numeric_columns, plan.categorical_columns, plan.label_kind)
    quarantined: list[pa.Table] = []
    bad_examples: list[str] = []
    read = bad = 0
    sample_rows: list[dict[str, Any]] = []
    for batch in sources.read_unit(unit, plan.fmt, batch_rows=plan.batch_rows, string_columns=plan.text_columns):
        if _parent_gone(plan):
            raise SystemExit(f"the preparing process {plan.parent_pid} is gone; stopping")
        n = batch.table.num_rows
        _check_columns(batch.table.schema.names, plan.columns, batch.origins[0])
        table, problems = conform(batch, plan)
        read += n
        if problems:
            if plan.on_bad_rows == "fail":
                row, column, problem = problems[0]
                raise DataError(f"{batch.where(row)}, column {column!r}: {problem}")
            bad += len(problems)
            bad_examples += [f"{batch.where(r)}, column {c!r}: {p}" for r, c, p in problems[:_BAD_EXAMPLES]]
            quarantined.append(_quarantine_rows(batch, problems))
            good = np.ones(n, bool)
            good[[r for r, _, _ in problems]] = False
            table = table.filter(pa.array(good))
            keys = batch.keys[good]
        else:
            keys = batch.keys
        if plan.key_column:
            keys = splits.key_hashes(table.column(plan.key_column).to_pylist())
        codes = splits.assign(keys, seed=plan.split_seed, val_fraction=plan.val_fraction,
                              test_fraction=plan.test_fraction)
        _update_stats(stats, table, codes == 0, plan)
        # Rows grouped by split (stable: input order within a split), so each split's samples are one
        # contiguous run of the encoded buffer.
        order = np.argsort(codes, kind="stable")
        buf, bounds = mds.encode_batch(plan.encodings, table.take(pa.array(order)))
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
    return {"unit": unit.index, "read": read, "bad": bad, "bad_examples": bad_examples[:_BAD_EXAMPLES],
            "rows": {s: w.rows for s, w in writers.items()}, "stats": stats.to_dict(), "sample_rows": sample_rows}


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
    for item in pc.value_counts(table.column(plan.label_column)).to_pylist():
        stats.labels[item["values"]] += item["counts"]


# --- row validation -----------------------------------------------------------------------------

def conform(batch: sources.Batch, plan: Plan):
    """The batch as the MDS columns expect it, and its bad rows as ``(row, column, problem)``, first
    problem per row, in row order."""
    import pyarrow as pa

    n = batch.table.num_rows
    problems: dict[int, tuple[str, str]] = {}

    def flag(mask: np.ndarray, column: str, describe) -> None:
        for i in np.flatnonzero(mask):
            problems.setdefault(int(i), (column, describe(int(i))))

    out = {}
    for name in plan.columns:
        column = batch.table.column(name)
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        encoding = plan.encodings[name]
        try:
            if name in plan.numeric_columns:
                out[name] = _numbers(column, encoding, name, flag, "a finite number")
            elif name == plan.label_column:
                out[name] = _label(column, plan, flag)
            elif name in plan.image_columns:
                out[name] = _images(column, encoding, name, flag)
            elif name in plan.array_columns:
                out[name] = _arrays(column, name, flag)
            else:  # categorical or key: text, missing as ""
                if name == plan.key_column:
                    flag(column.is_null().to_numpy(zero_copy_only=False), name, lambda i: "key is null; expected a value")
                out[name] = _text(column)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, AttributeError) as exc:
            # A file whose column has another type than the first file's, with no per-value reading.
            raise DataError(f"{batch.origins[0]}: column {name!r} has type {column.type}, which does not convert "
                            f"to the column's encoding {encoding!r} ({exc})") from None
    return pa.table(out), [(i, *problems[i]) for i in sorted(problems)]


def _text(column):
    import pyarrow as pa

    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    return column.cast(pa.string()).fill_null(MISSING)


def _numbers(column, encoding: str, name: str, flag, expected: str):
    """Numbers of ``encoding``; text is parsed per value (CSV), so a wrong value is one bad row."""
    import pandas as pd
    import pyarrow as pa

    null = column.is_null().to_numpy(zero_copy_only=False)
    flag(null, name, lambda i: f"value is null; expected {expected}")
    integral = encoding.startswith(("int", "uint"))
    if pa.types.is_integer(column.type) or pa.types.is_boolean(column.type):
        if integral:
            return pa.array(column.fill_null(0).cast(pa.int64()).to_numpy(zero_copy_only=False).astype(encoding))
        values = column.cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False)
    elif pa.types.is_floating(column.type):
        values = column.cast(pa.float64()).to_numpy(zero_copy_only=False)
    else:
        text = _text(column).to_numpy(zero_copy_only=False)
        values = pd.to_numeric(pd.Series(text), errors="coerce").to_numpy(np.float64, copy=True)
        lowered = np.char.lower(text.astype(str))
        values[lowered == "true"], values[lowered == "false"] = 1.0, 0.0  # CSV booleans
        wrong = np.isnan(values) & ~null & (lowered != "nan")
        flag(wrong, name, lambda i: f"value {text[i]!r}; expected {'an integer' if integral else 'a number'}")
    finite = np.isfinite(values)
    flag(~finite & ~null, name, lambda i: f"value {float(values[i])!r}; expected {expected}")
    if integral:
        whole = finite & (values == np.round(values))
        flag(finite & ~whole, name, lambda i: f"value {float(values[i])!r}; expected an integer")
        return pa.array(np.where(whole, values, 0).astype(encoding))
    return pa.array(np.where(finite, values, 0.0).astype(encoding))


def _label(column, plan: Plan, flag):
    import pyarrow as pa

    name = plan.label_column
    if plan.label_kind == "int":
        values = _numbers(column, plan.encodings[name], name, flag, "an integer class label")
    else:
        null = column.is_null().to_numpy(zero_copy_only=False)
        flag(null, name, lambda i: "label is null; expected a class label")
        values = _text(column)
    if plan.declared_classes:
        text = [str(v) for v in values.to_pylist()]
        allowed = set(plan.declared_classes)
        outside = np.array([t not in allowed for t in text], dtype=bool)
        flag(outside, name, lambda i: f"label {text[i]!r}; expected one of {plan.declared_classes}")
    return values if isinstance(values, pa.Array) else pa.array(values)


def _images(column, encoding: str, name: str, flag):
    """Every image decoded once (a truncated or foreign file is a bad row), re-encoded only when its
    format differs from the column's encoding."""
    import pyarrow as pa
    from PIL import Image

    if encoding.startswith("ndarray:"):
        return column
    if isinstance(column.type, pa.FixedShapeTensorType):
        arrays = column.to_numpy_ndarray()
        return pa.array([_encode_image(Image.fromarray(a), encoding) for a in arrays], pa.binary())
    blobs = column.to_pylist()
    out = []
    for i, blob in enumerate(blobs):
        if blob is None:
            flag(np.arange(len(blobs)) == i, name, lambda _: "image is null; expected a PNG or JPEG image")
            out.append(b"")
            continue
        try:
            with Image.open(io.BytesIO(blob)) as image:
                image.load()
                if mds.image_format(blob) != encoding:
                    blob = _encode_image(image, encoding)
        except Exception as exc:  # PIL raises many types for a bad file
            problem = f"value of {len(blob)} bytes is not a decodable image ({type(exc).__name__}: {exc}); expected a PNG or JPEG image"
            flag(np.arange(len(blobs)) == i, name, lambda _, p=problem: p)
            blob = b""
        out.append(blob)
    return pa.array(out, pa.binary())


def _encode_image(image, encoding: str) -> bytes:
    out = io.BytesIO()
    if encoding == "jpeg" and image.mode not in ("L", "RGB"):
        image = image.convert("RGB")
    image.save(out, format="PNG" if encoding == "png" else "JPEG")
    return out.getvalue()


def _arrays(column, name: str, flag):
    import pyarrow as pa

    null = column.is_null().to_numpy(zero_copy_only=False)
    flag(null, name, lambda i: "array is null; expected a fixed-shape array")
    storage = column.storage if isinstance(column, pa.ExtensionArray) else column
    width = storage.type.list_size
    values = storage.flatten().to_numpy(zero_copy_only=False)
    if values.dtype.kind == "f" and len(values) == len(column) * width:
        bad = ~np.isfinite(values.reshape(len(column), width)).all(axis=1)
        flag(bad, name, lambda i: "array holds NaN or inf; expected finite numbers")
    return column


def _quarantine_rows(batch: sources.Batch, problems: list[tuple[int, str, str]]):
    """The bad rows as they came (text, images as bytes) with where and why, for quarantine.parquet."""
    import pyarrow as pa

    rows = pa.array([r for r, _, _ in problems])
    picked = batch.table.take(rows)
    out = {}
    for name in picked.schema.names:
        column = picked.column(name)
        if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            out[name] = column.cast(pa.binary())
        else:
            try:
                out[name] = column.cast(pa.string())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                out[name] = pa.array([None if v is None else str(v) for v in column.to_pylist()], pa.string())
    out["_source"] = pa.array([batch.where(r) for r, _, _ in problems], pa.string())
    out["_column"] = pa.array([c for _, c, _ in problems], pa.string())
    out["_error"] = pa.array([p for _, _, p in problems], pa.string())
    return pa.table(out)


# --- publishing ---------------------------------------------------------------------------------

def _assemble(cfg: DataConfig, plan: Plan, name: str, version: str, final: Path, tmp: Path,
              described: list[dict[str, Any]], results: list[dict[str, Any]], interval, started: float,
              timings: dict[str, float]) -> dict[str, Any]:
    """Merge the workers' parts, statistics and quarantines; check the whole; write the manifest last."""
    read = sum(r["read"] for r in results)
    bad = sum(r["bad"] for r in results)
    if read == 0:
        raise DataError(f"{cfg.input_path}: the input has no rows")
    if bad:
        examples = [e for r in results for e in r["bad_examples"]][:_BAD_EXAMPLES]
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
    if len(prep["label_classes"]) < 2:
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
    shards = {}
    for split in splits.SPLITS:
        shards[split] = [
            {"basename": s["zip_data"]["basename"] if s.get("zip_data") else s["raw_data"]["basename"],
             "samples": s["samples"],
             **(s["zip_data"] or s["raw_data"])["hashes"]}
            for s in mds.merge_parts(tmp / split)
        ]
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
        "uri": final.as_uri(),
        "created_at": datetime.now(timezone.utc).isoformat(),
        "interval": {"start": interval[0], "end": interval[1]} if interval else None,
        "sources": described,
        "config": asdict(cfg),
        "schema": plan.schema(),
        "label_classes": prep["label_classes"],
        "splits": rows,
        "shards": shards,
        "bad_rows": {"count": bad, "read": read, "fraction": round(bad / read, 6), "policy": plan.on_bad_rows,
                     "quarantine": QUARANTINE if quarantine else None},
        "sample_rows": sample_rows,
        "workers": min(cfg.workers, len(results)),
        "units": len(results),
        "prep_wall_s": round(time.perf_counter() - started, 3),
    }
    # Where the time went: hashing the inputs, planning (and staging IDX), converting, merging.
    timings["merge"] = manifest["prep_wall_s"] - sum(timings.values())
    manifest["timings_s"] = {k: round(v, 3) for k, v in timings.items()}
    _write_json(tmp / MANIFEST, manifest)  # written last: its presence marks a complete version
    return manifest


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
