"""What training and evaluation read: one or more dataset versions as the streams of one StreamingDataset.

Versions store raw values; their statistics merge into the preprocessing of the whole window
(vocabularies, mean/std, label classes), and ``collate`` encodes categories and labels with it. So a
window of daily versions reads as one dataset, whatever vocabulary each day had on its own.

``TrainingData.loader`` keeps streaming's partition, shuffle and mid-epoch resumption but reads each batch
as one piece from memory-mapped shards, decoded by column (the batch path, at the end of this module).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pipeline.data import local_path
from pipeline.data.prep import read_manifest, read_stats
from pipeline.errors import DataError


@dataclass
class TrainingData:
    """The dataset versions a training run reads, with the encoding the model is built for."""

    dirs: list[Path]
    manifests: list[dict[str, Any]]
    preprocessing: dict[str, Any]
    cache_dir: Path
    stats: Any = None  # the versions' merged statistics (pipeline.data.stats.Stats): counts per category

    @classmethod
    def open(cls, datasets: list[str], cache_dir: Path) -> "TrainingData":
        if isinstance(datasets, (str, Path)):
            datasets = [str(datasets)]
        if not datasets:
            raise DataError("no dataset versions to read: expected at least one dataset URI")
        dirs = [local_path(str(uri)) for uri in datasets]
        manifests = []
        for d in dirs:
            try:
                manifests.append(read_manifest(d))
            except FileNotFoundError:
                raise DataError(f"{d}: no published dataset version here (no manifest.json)") from None
        first = manifests[0]
        for d, m in zip(dirs[1:], manifests[1:]):
            # The columns, their roles and encodings must agree; the input format may differ.
            if _columns(m) != _columns(first):
                raise DataError(
                    f"{d}: version {m['version']} has columns {m['schema']['encodings']}, version "
                    f"{first['version']} has {first['schema']['encodings']}; a window reads versions of one schema"
                )
        stats = read_stats(dirs[0])
        for d in dirs[1:]:
            stats.merge(read_stats(d))
        declared = first["config"].get("label_classes") or None
        return cls(dirs=dirs, manifests=manifests, preprocessing=stats.preprocessing(declared), cache_dir=Path(cache_dir),
                   stats=stats)

    @property
    def versions(self) -> list[str]:
        return [m["version"] for m in self.manifests]

    @property
    def schema(self) -> dict[str, Any]:
        return self.manifests[0]["schema"]

    @property
    def sample_rows(self) -> list[dict[str, Any]]:
        return self.manifests[-1]["sample_rows"]

    def rows(self, split: str) -> int:
        return sum(m["splits"][split] for m in self.manifests)

    def write_preprocessing(self, path: Path) -> Path:
        """The window's preprocessing as a file (what the registered model carries)."""
        import json

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.preprocessing, indent=2))
        return path

    def dataset(self, split: str, *, shuffle: bool, seed: int, batch_size: int | None = None, batched: bool = False):
        """The split's versions as the streams of one ``StreamingDataset`` (a ``BatchDataset``, which
        iterates by whole batches, when ``batched``)."""
        from streaming import Stream, StreamingDataset

        # Each published version is one stream's remote; each job gets its own local cache: two jobs
        # reading one version at once would otherwise collide on streaming's per-directory shared memory.
        streams = [
            Stream(remote=str(d / split), local=str(self.cache_dir / m["version"] / split))
            for d, m in zip(self.dirs, self.manifests) if m["splits"][split]
        ]
        if not streams:
            raise DataError(f"split {split!r} has no rows in dataset version(s) {self.versions}")
        kind = _batch_classes()["BatchDataset"] if batched else StreamingDataset
        return kind(streams=streams, split=None, shuffle=shuffle, shuffle_seed=seed, batch_size=batch_size)

    def loader(self, split: str, *, batch_size: int, shuffle: bool, seed: int, num_workers: int = 0,
               transform: Callable[[dict[str, Any]], Any]):
        """A resumable loader (a ``BatchLoader``) over this rank's share of ``split``: ``state_dict`` and
        ``load_state_dict`` give a mid-epoch position. Each batch is ``transform(columns)``, ``columns``
        being the batch's decoded columns (see ``decode_columns``); ``transform`` must be picklable when
        ``num_workers > 0``.

        Batches hold the samples, in the order, of a ``StreamingDataLoader`` over ``dataset(split)``, but
        a batch is read as one piece from memory-mapped shards and decoded by column with numpy (see
        ``BatchDataset``): keep ``num_workers=0`` unless images take long to decode and cores are spare."""
        import torch

        dataset = self.dataset(split, shuffle=shuffle, seed=seed, batch_size=batch_size, batched=True)
        # Loaders draw a base seed at every iter(); from their own generator, so that the global stream
        # (dropout, augmentation) is the same after a mid-epoch resume as in an uninterrupted run.
        return _batch_classes()["BatchLoader"](dataset, num_workers=num_workers, transform=transform,
                                               generator=torch.Generator().manual_seed(seed))

    def sample_loader(self, split: str, *, batch_size: int, shuffle: bool, seed: int, num_workers: int = 0,
                      transform: Callable[[dict[str, Any]], Any]):
        """``loader`` the per-sample way: streaming's ``__getitem__`` decodes each sample, then
        ``decode_columns`` stacks them. Same batches, several times slower; the reference the fast
        path is tested and benchmarked against."""
        import torch
        from streaming import StreamingDataLoader

        dataset = self.dataset(split, shuffle=shuffle, seed=seed, batch_size=batch_size)
        return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                   collate_fn=_Collate(transform), generator=torch.Generator().manual_seed(seed))

    def read_split(self, split: str) -> dict[str, Any]:
        """Every row of ``split`` (all versions, in order) as decoded columns (see ``decode_columns``)."""
        dataset = self.dataset(split, shuffle=False, seed=0, batched=True)
        return dataset.read_all(self.schema["columns"])

    @cached_property
    def encoder(self) -> "Encoder":
        return Encoder(self.preprocessing, self.schema["label_column"])

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """Samples -> tensors ``num`` float32 [B, F], ``cat`` int64 [B, C], ``label`` int64 [B]."""
        import torch

        num, cat, label = self.encoder.encode(samples)
        return {"num": torch.from_numpy(num), "cat": torch.from_numpy(cat), "label": torch.from_numpy(label)}

    def frame(self, split: str):
        """A split as raw feature rows (what the registered model scores) and label indices."""
        columns = self.read_split(split)
        _, _, labels = self.encoder.encode_columns(columns)
        return feature_frame(columns, self.preprocessing), labels


def feature_frame(columns: dict[str, Any], preprocessing: dict[str, Any]):
    """Numeric and categorical feature columns as the DataFrame of raw rows a tabular model scores."""
    import pandas as pd

    frame = pd.DataFrame({c: np.asarray(columns[c], dtype=np.float64) for c in preprocessing["numeric_columns"]})
    for c in preprocessing["categorical_columns"]:
        # A missing category is stored as "", and scored as one (the model's unknown code).
        frame[c] = pd.Series([v or None for v in columns[c]], dtype=object)
    return frame


class Encoder:
    """Raw samples -> model inputs, with one window's vocabularies and label classes."""

    def __init__(self, preprocessing: dict[str, Any], label_column: str):
        self.numeric = preprocessing["numeric_columns"]
        self.categorical = preprocessing["categorical_columns"]
        self.code_of = {c: {v: i for i, v in enumerate(preprocessing["vocab"][c])} for c in self.categorical}
        self.label_column = label_column
        self.label_index = {label: i for i, label in enumerate(preprocessing["label_classes"])}

    def encode(self, samples: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # np.array copies, so the tensors own writable memory (streaming hands out read-only views).
        num = np.array([[s[c] for c in self.numeric] for s in samples], dtype=np.float32).reshape(len(samples), len(self.numeric))
        cat = np.array([[self.code_of[c].get(s[c], 0) for c in self.categorical] for s in samples],
                       dtype=np.int64).reshape(len(samples), len(self.categorical))
        try:
            label = np.array([self.label_index[_label(s[self.label_column])] for s in samples], dtype=np.int64)
        except KeyError as exc:
            raise DataError(f"label {exc.args[0]!r} is not one of the classes {list(self.label_index)}") from None
        return num, cat, label

    def encode_columns(self, columns: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decoded columns (``decode_columns``) -> ``num`` float32 [B, F], ``cat`` int64 [B, C], ``label`` int64 [B]
        (empty without a label column)."""
        rows = len(columns[self.label_column] if self.label_column else next(iter(columns.values())))
        num = np.empty((rows, len(self.numeric)), dtype=np.float32)
        for j, c in enumerate(self.numeric):
            num[:, j] = columns[c]
        cat = np.zeros((rows, len(self.categorical)), dtype=np.int64)
        # tolist() gives Python values, as _label does, at a tenth of the cost of a call per value; map()
        # looks them up without a bytecode loop (half a list comprehension's time).
        for j, c in enumerate(self.categorical):
            cat[:, j] = np.fromiter(map(self.code_of[c].get, np.asarray(columns[c]).tolist(), repeat(0)),
                                    np.int64, rows)
        if not self.label_column:  # data without labels
            return num, cat, np.zeros(0, np.int64)
        try:
            label = np.fromiter(map(self.label_index.__getitem__, np.asarray(columns[self.label_column]).tolist()),
                                np.int64, rows)
        except KeyError as exc:
            raise DataError(f"label {exc.args[0]!r} is not one of the classes {list(self.label_index)}") from None
        return num, cat, label


def decode_columns(samples: list[dict[str, Any]], columns: list[str]) -> dict[str, Any]:
    """Samples -> one numpy array per column: numbers as int64/float arrays, text as an object array,
    images (PNG/JPEG or arrays) as one uint8 array [B, H, W] or [B, H, W, C] when their shapes agree."""
    out: dict[str, Any] = {}
    for c in columns:
        values = [s[c] for s in samples]
        first = values[0] if values else None
        if isinstance(first, np.ndarray):
            out[c] = _stack(values)
        elif first is not None and hasattr(first, "mode") and hasattr(first, "size"):  # PIL image
            out[c] = _stack([np.asarray(v) for v in values])
        elif isinstance(first, (str, bytes)) or first is None:
            out[c] = _objects(values)
        else:
            out[c] = np.asarray(values)
    return out


class _Collate:
    """Picklable collate: decode the batch's columns, then the recipe's transform."""

    def __init__(self, transform: Callable[[dict[str, Any]], Any]):
        self.transform = transform

    def __call__(self, samples: list[dict[str, Any]]) -> Any:
        return self.transform(decode_columns(samples, list(samples[0]) if samples else []))


def _columns(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in manifest["schema"].items() if k != "fmt"}


def _label(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


# ---------------------------------------------------------------------------------------------------------
# The batch path: streaming's partition, order and resumption; whole batches read from memory maps.
#
# An MDS shard file is: uint32 sample count n, n + 1 uint32 byte offsets, then the samples back to back.
# A sample is a uint32 size per variable-size column, then every column's bytes, columns in the index's
# order (sorted names). So with fixed-size columns only (numbers, ndarray:DTYPE:SHAPE) a shard is a
# [n, row_bytes] array, and a batch is a row gather plus a reinterpretation per column. With text columns
# too, a shard is turned once into columns (numbers typed, text as dictionary codes) and a batch is a
# take per column. Images (PNG/JPEG) still need one decoder call per value.

_SHARD_MAPS = 256  # memory maps kept open per process (each holds a file descriptor)
_COLUMNAR_BYTES = 256 << 20  # shards kept as columns per process
_PREPARE_CHUNK = 8192  # sample ids the download threads look at per pass
_POLL_S = 0.001  # our waits for a shard or the ready thread (streaming's 7 ms tick added ~40 ms per epoch start)


class _Layout:
    """The byte layout of one MDS column set: which columns are fixed-size, their dtypes and offsets."""

    def __init__(self, names: list[str], encodings: list[str], sizes: list[int | None]):
        self.names = list(names)
        self.kinds: list[tuple] = []  # ("fixed", dtype, shape) | ("str",) | ("bytes",) | ("image",) | ("other", enc)
        for encoding, size in zip(encodings, sizes):
            kind = _column_kind(encoding)
            if kind[0] == "fixed" and kind[1].itemsize * int(np.prod(kind[2], dtype=np.int64)) != size:
                kind = ("other", encoding)  # not the layout we know: decode it streaming's way
            elif kind[0] != "fixed" and size:
                kind = ("other", encoding)
            self.kinds.append(kind)
        self.sizes = [s or 0 for s in sizes]
        self.variable = [i for i, s in enumerate(sizes) if not s]  # their uint32 sizes head each sample
        self.row_bytes = sum(self.sizes) if not self.variable else None  # every sample the same length
        # Fixed-size numbers and text only: a shard is worth turning into columns once.
        self.columnar = self.row_bytes is None and all(k[0] in ("fixed", "str") for k in self.kinds)
        # Runs of adjacent fixed-size columns: (first column, [(column, offset in the run)], run bytes); one
        # gather reads a run for many samples.
        self.fixed_runs: list[tuple[int, list[tuple[int, int]], int]] = []
        for i, size in enumerate(self.sizes):
            if not size:
                continue
            if self.fixed_runs and self.fixed_runs[-1][0] + len(self.fixed_runs[-1][1]) == i:
                first, members, width = self.fixed_runs[-1]
                self.fixed_runs[-1] = (first, members + [(i, width)], width + size)
            else:
                self.fixed_runs.append((i, [(i, 0)], size))

    def empty(self, rows: int) -> dict[str, np.ndarray]:
        return {name: np.empty((rows, *kind[2]), kind[1]) if kind[0] == "fixed" else np.empty(rows, dtype=object)
                for name, kind in zip(self.names, self.kinds)}


def _column_kind(encoding: str) -> tuple:
    if encoding in ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
                    "float16", "float32", "float64"):
        return ("fixed", np.dtype(encoding), ())
    parts = encoding.split(":")
    if len(parts) == 3 and parts[0] == "ndarray" and parts[2] and all(d.isdigit() for d in parts[2].split(",")):
        try:
            return ("fixed", np.dtype(parts[1]), tuple(int(d) for d in parts[2].split(",")))
        except TypeError:
            pass
    if encoding == "str":
        return ("str",)
    if encoding == "bytes":
        return ("bytes",)
    if encoding in ("png", "jpeg"):
        return ("image",)
    return ("other", encoding)


class _ShardReader:
    """Batches of samples from local raw MDS shards of one layout (one per process: maps are not shared).

    ``paths[i]`` is shard i's raw file, ``first_sample[i]`` its first global sample id, ``make_local(i)``
    brings a missing raw file back (streaming's ``prepare_shard``)."""

    def __init__(self, layout: _Layout, paths: list[str], first_sample: np.ndarray,
                 make_local: Callable[[int], None]):
        import collections

        self.layout, self.paths, self.first_sample, self.make_local = layout, paths, first_sample, make_local
        self.maps: collections.OrderedDict[int, tuple[np.ndarray, np.ndarray]] = collections.OrderedDict()
        self.columns: collections.OrderedDict[int, tuple[dict[str, Any], int]] = collections.OrderedDict()
        self.columns_bytes = 0

    def read(self, sample_ids: np.ndarray) -> dict[str, Any]:
        """The samples ``sample_ids`` (global ids), in that order, as decoded columns."""
        layout = self.layout
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        rows = len(sample_ids)
        shards = np.searchsorted(self.first_sample, sample_ids, side="right") - 1
        within = sample_ids - self.first_sample[shards]
        if rows and shards[0] == shards[-1] and (shards == shards[0]).all():
            runs = [(int(shards[0]), slice(None))]  # the common case: one shard
        else:
            order = np.argsort(shards, kind="stable")
            cuts = np.flatnonzero(np.diff(shards[order])) + 1
            runs = [(int(shards[run[0]]), run) for run in np.split(order, cuts)] if rows else []
        if layout.row_bytes is not None:
            return self._read_rows(runs, within, rows)
        if layout.columnar:
            return self._read_columnar(runs, within, rows)
        return self._read_samples(runs, within, rows)

    def _read_rows(self, runs, within: np.ndarray, rows: int) -> dict[str, Any]:
        """Fixed-size columns only: a shard is a [n, row_bytes] array; gather rows, split columns."""
        data = np.empty((rows, self.layout.row_bytes), np.uint8)
        for shard_id, run in runs:
            data[run] = self._table(shard_id)[within[run]]
        return _split_fixed(self.layout, data, self.layout.fixed_runs[0][1]) if rows else self.layout.empty(0)

    def _read_columnar(self, runs, within: np.ndarray, rows: int) -> dict[str, Any]:
        """Numbers and text: take each column's values from the shard's columns."""
        layout = self.layout
        if len(runs) == 1:
            shard_id, _ = runs[0]
            columns = self._shard_columns(shard_id)
            return {name: _take(columns[name], within) for name in layout.names}
        out = layout.empty(rows)
        for shard_id, run in runs:
            columns = self._shard_columns(shard_id)
            for name in layout.names:
                out[name][run] = _take(columns[name], within[run])
        return out

    def _read_samples(self, runs, within: np.ndarray, rows: int) -> dict[str, Any]:
        """Images or other encodings: gather the samples' bytes into one buffer, then decode by column."""
        begins = np.empty(rows, np.int64)
        lengths = np.empty(rows, np.int64)
        bufs = []
        for shard_id, run in runs:
            buf, offsets = self._map(shard_id)
            begins[run] = offsets[within[run]]
            lengths[run] = offsets[within[run] + 1] - begins[run]
            bufs.append(buf)
        starts = np.cumsum(lengths) - lengths
        flat = np.empty(int(lengths.sum()), np.uint8)
        for (_, run), buf in zip(runs, bufs):
            flat[_ranges(starts[run], lengths[run])] = _gather(buf, begins[run], lengths[run])
        return _decode(self.layout, flat, starts, rows)

    def _map(self, shard_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(the shard file's bytes, its n + 1 sample offsets as int64)."""
        import mmap

        entry = self.maps.get(shard_id)
        if entry is not None:
            self.maps.move_to_end(shard_id)
            return entry
        try:
            f = open(self.paths[shard_id], "rb")
        except FileNotFoundError:  # only the compressed file is here, or it was evicted
            self.make_local(shard_id)
            f = open(self.paths[shard_id], "rb")
        with f:
            # A plain ndarray over the map (np.memmap's indexing is several times slower); the map and its
            # file descriptor go when the last array over it does.
            buf = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
        count = int(buf[:4].view(np.uint32)[0])
        offsets = buf[4:4 + 4 * (count + 1)].view(np.uint32).astype(np.int64)
        self.maps[shard_id] = entry = (buf, offsets)
        while len(self.maps) > _SHARD_MAPS:
            self.maps.popitem(last=False)
        return entry

    def _table(self, shard_id: int) -> np.ndarray:
        buf, offsets = self._map(shard_id)
        count, width = len(offsets) - 1, self.layout.row_bytes
        if offsets[-1] - offsets[0] != count * width:
            raise DataError(f"{self.paths[shard_id]}: samples are not {width} bytes each, as the index's column "
                            f"sizes say")
        return buf[offsets[0]:offsets[-1]].reshape(count, width)

    def _shard_columns(self, shard_id: int) -> dict[str, Any]:
        entry = self.columns.get(shard_id)
        if entry is not None:
            self.columns.move_to_end(shard_id)
            return entry[0]
        buf, offsets = self._map(shard_id)
        starts = offsets[:-1] - offsets[0]
        columns = _decode(self.layout, buf[offsets[0]:offsets[-1]], starts, len(starts), text_codes=True)
        size = sum(v.nbytes if isinstance(v, np.ndarray) else v[0].nbytes + 64 * len(v[1]) for v in columns.values())
        self.columns[shard_id] = (columns, size)
        self.columns_bytes += size
        while self.columns_bytes > _COLUMNAR_BYTES and len(self.columns) > 1:
            _, (_, dropped) = self.columns.popitem(last=False)
            self.columns_bytes -= dropped
        return columns


def _take(column, index: np.ndarray) -> np.ndarray:
    if isinstance(column, tuple):  # text: (codes, distinct values)
        codes, values = column
        return values[codes[index]]
    return column[index]


def _split_fixed(layout: _Layout, data: np.ndarray, members: list[tuple[int, int]]) -> dict[str, Any]:
    """Adjacent fixed-size columns of many samples, as a [rows, bytes] array -> their columns."""
    from streaming.base.format.mds.encodings import mds_decode

    out: dict[str, Any] = {}
    for j, at in members:
        name, kind, size = layout.names[j], layout.kinds[j], layout.sizes[j]
        values = np.ascontiguousarray(data[:, at:at + size])
        if kind[0] == "fixed":
            out[name] = values.view(kind[1]).reshape(len(data), *kind[2])
        else:
            out[name] = decode_columns([{name: mds_decode(kind[1], v.tobytes())} for v in values], [name])[name]
    return out


def _decode(layout: _Layout, flat: np.ndarray, starts: np.ndarray, rows: int,
            text_codes: bool = False) -> dict[str, Any]:
    """Samples back to back in ``flat`` (sample i at ``starts[i]``) -> columns; with ``text_codes``, a text
    column is (codes, distinct values) instead of an object array."""
    from streaming.base.format.mds.encodings import mds_decode

    if not rows:
        return layout.empty(0)
    sizes = np.empty((rows, len(layout.names)), np.int64)
    sizes[:] = layout.sizes
    head = 4 * len(layout.variable)
    if layout.variable:
        sizes[:, layout.variable] = _gather_rows(flat, starts, head).view(np.uint32).reshape(rows, -1)
    column_starts = starts[:, None] + head + np.cumsum(sizes, axis=1) - sizes
    out: dict[str, Any] = {}
    for first, members, width in layout.fixed_runs:
        out |= _split_fixed(layout, _gather_rows(flat, column_starts[:, first], width), members)
    for j, (name, kind) in enumerate(zip(layout.names, layout.kinds)):
        if layout.sizes[j]:
            continue
        at, width = column_starts[:, j], sizes[:, j]
        if kind[0] in ("str", "bytes"):
            out[name] = _text(_gather(flat, at, width), width, binary=kind[0] == "bytes", codes=text_codes)
        elif kind[0] == "image":
            out[name] = _images(flat, at.tolist(), width.tolist())
        else:
            values = [mds_decode(kind[1], flat[a:a + w].tobytes()) for a, w in zip(at.tolist(), width.tolist())]
            out[name] = decode_columns([{name: v} for v in values], [name])[name]
    return {name: out[name] for name in layout.names}  # in the samples' order, as streaming gives them


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices of the ranges ``starts[i]:starts[i] + lengths[i]``, concatenated."""
    total = int(lengths.sum())
    out_starts = np.cumsum(lengths) - lengths
    return np.repeat(starts - out_starts, lengths) + np.arange(total, dtype=np.int64)


def _gather(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The byte ranges ``buf[starts[i]:starts[i] + lengths[i]]``, concatenated."""
    return buf[_ranges(starts, lengths)]


def _gather_rows(buf: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """``buf[starts[i]:starts[i] + width]`` for every i, as a [len(starts), width] array."""
    if width == 0:
        return np.zeros((len(starts), 0), np.uint8)
    if len(starts) * width < 1 << 16:  # small: an index per byte beats the window view's set-up
        return buf[starts[:, None] + np.arange(width, dtype=np.int64)]
    return np.lib.stride_tricks.sliding_window_view(buf, width)[starts]  # a copy of width bytes per row


def _text(data: np.ndarray, lengths: np.ndarray, binary: bool, codes: bool = False):
    """Concatenated values and their lengths -> an object array of str (or bytes); with ``codes``,
    (int32 codes, object array of the distinct values)."""
    import pyarrow as pa

    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    kind = pa.large_binary() if binary else pa.large_string()
    array = pa.Array.from_buffers(kind, len(lengths), [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    if not binary:
        array.validate(full=True)  # bad UTF-8 raises here, as bytes.decode would
    if codes:
        encoded = array.dictionary_encode()
        return encoded.indices.to_numpy(), encoded.dictionary.to_numpy(zero_copy_only=False)
    return array.to_numpy(zero_copy_only=False)


def _images(flat: np.ndarray, starts: list[int], lengths: list[int]) -> np.ndarray:
    """Encoded images (``flat[start:start + length]``) -> uint8 [B, H, W(, C)] exactly as
    ``np.asarray(PIL.Image.open(...))`` gives them (an object array of arrays when their shapes differ).

    PNGs of 8-bit gray, gray+alpha, RGB or RGBA without a transparency chunk, which any correct decoder
    turns into the same pixels, go through torchvision's libpng decoder: 1.6x PIL's speed for small
    images, whose decoding is mostly PIL's Python. Anything else (palettes, other bit depths, JPEG) is
    PIL's."""
    import io

    import torch
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_png

    data = torch.from_numpy(flat)
    out = []
    for start, length in zip(starts, lengths):
        blob = flat[start:start + min(length, 4096)].tobytes()  # the header chunks, to check the PNG kind
        if _plain_png(blob):
            try:
                pixels = decode_png(data[start:start + length], ImageReadMode.UNCHANGED).numpy()
                out.append(pixels[0] if pixels.shape[0] == 1 else pixels.transpose(1, 2, 0))
                continue
            except RuntimeError:  # let PIL decode it, or say what is wrong with it
                pass
        out.append(np.asarray(Image.open(io.BytesIO(flat[start:start + length].tobytes()))))
    return _stack(out)


def _plain_png(head: bytes) -> bool:
    """An 8-bit PNG of color type 0, 2, 4 or 6 (gray, RGB, gray+alpha, RGBA) with no tRNS chunk before its
    first IDAT (``head`` must hold that far)."""
    if len(head) < 33 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR" or head[24] != 8 \
            or head[25] not in (0, 2, 4, 6):
        return False
    at = 8
    while at + 8 <= len(head):
        size, kind = int.from_bytes(head[at:at + 4], "big"), head[at + 4:at + 8]
        if kind == b"IDAT":
            return True
        if kind == b"tRNS":
            return False
        at += 12 + size
    return False  # no IDAT in the head: leave it to PIL


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    """Arrays of one shape and dtype -> one array [B, ...]; otherwise an object array of them."""
    if arrays and all(a.shape == arrays[0].shape and a.dtype == arrays[0].dtype for a in arrays):
        return np.stack(arrays)
    return _objects(arrays)


def _objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element by element: numpy would make arrays of nested sequences
        out[i] = v
    return out


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    if len(parts) == 1:
        return parts[0]
    if len({(p.dtype, p.shape[1:]) for p in parts}) == 1:
        return np.concatenate(parts)
    return _stack([v for p in parts for v in p])  # images whose shapes differ between chunks


class _Apply:
    """Picklable: ``(count, columns)`` -> ``(count, transform(columns))``."""

    def __init__(self, transform: Callable[[dict[str, Any]], Any]):
        self.transform = transform

    def __call__(self, item: tuple[int, dict[str, Any]]) -> tuple[int, Any]:
        count, columns = item
        return count, self.transform(columns)


def __getattr__(name: str):
    # BatchDataset and BatchLoader subclass streaming's classes; importing streaming (and torch) is put off
    # until one is used, so that importing this module stays cheap. Pickle finds them here too.
    if name in ("BatchDataset", "BatchLoader"):
        return _batch_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _batch_classes() -> dict[str, type]:
    if "_BATCH_CLASSES" in globals():
        return globals()["_BATCH_CLASSES"]
    import os
    from concurrent.futures import ThreadPoolExecutor, wait
    from threading import Event
    from time import sleep

    from filelock import FileLock
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.constant import TICK
    from streaming.base.dataset import _Iterator, _ShardState
    from torch.utils.data import DataLoader

    class BatchDataset(StreamingDataset):
        """A ``StreamingDataset`` whose iteration yields ``(count, columns)`` per batch of ``batch_size``.

        The samples of each batch, and their order, are those a ``DataLoader(batch_size=batch_size)`` over
        the plain dataset puts in it: this worker's share of the epoch, ``-1`` padding skipped, cut into
        runs of ``batch_size``. Partition, shuffle, ``state_dict``/``load_state_dict`` and shard downloads
        are streaming's; its download threads here look at sample ids a chunk at a time and visit each
        shard once per epoch (streaming takes a file lock per sample), and samples are read by
        ``_ShardReader`` (streaming opens the shard file and decodes each sample on its own).
        """

        def __iter__(self):
            # StreamingDataset.__iter__ (streaming 0.13), yielding batches instead of samples.
            if hasattr(self, "_iterator"):
                self._iterator.exit()
            if not hasattr(self, "_executor"):
                self._executor = ThreadPoolExecutor()
            if not hasattr(self, "_event"):
                self._event = Event()
            elif self._event.is_set():
                raise RuntimeError("Background thread failed. Check other traceback.")
            # Streaming creates the barrier's file lock on first use with filelock's default 50 ms polling: at
            # each epoch start the ranks of a node meet in the barrier, and a wait for its lock cost 50 ms a
            # time (50 to 150 ms per epoch start with 2 ranks). The same lock, polled every millisecond.
            if not hasattr(self._shared_barrier, "lock"):
                self._shared_barrier.lock = FileLock(self._shared_barrier.filelock_path, poll_interval=_POLL_S)
            self._unique_worker_world = self._unique_rank_world.detect_workers()
            self._parallel_worker_world = self._parallel_rank_world.detect_workers()
            epoch, sample_in_epoch = self._resume_incr_epoch()
            sample_ids = self._get_work(epoch, sample_in_epoch)
            if not len(sample_ids):  # resumed at the end of the epoch
                return
            self._iterator = it = _Iterator(sample_ids)
            prepare = self._executor.submit(self._prepare_thread, it)
            prepare.add_done_callback(self.on_exception)
            ready = self._executor.submit(self._ready_thread, it)
            ready.add_done_callback(self.on_exception)
            for ids in self._each_batch(it):
                yield len(ids), self.read_batch(ids)
            wait([prepare, ready], return_when="FIRST_EXCEPTION")
            it.exit()

        def _each_batch(self, it):
            """Streaming's yield loop, by batches: ids the ready thread has passed, ``-1`` skipped."""
            pending: list[np.ndarray] = []
            have = 0
            while not it.should_exit() and not self._event.is_set():
                if it.yield_index == it.total:
                    break
                ready = it.ready_index
                if ready <= it.yield_index:
                    sleep(_POLL_S)
                    continue
                chunk = it.sample_ids[it.yield_index:ready]
                valid = np.flatnonzero(chunk != -1)
                if have + len(valid) >= self.batch_size:
                    take = self.batch_size - have
                    pending.append(chunk[valid[:take]])
                    it.yield_index += int(valid[take - 1]) + 1
                    yield np.concatenate(pending)
                    pending, have = [], 0
                else:
                    pending.append(chunk[valid])
                    have += len(valid)
                    it.yield_index = ready
            if have and it.yield_index == it.total:
                yield np.concatenate(pending)
            it.on_exit()

        def _prepare_thread(self, it) -> None:
            def prepare(shard_id: int) -> bool:
                self.prepare_shard(shard_id, False)
                return self._shard_states[shard_id] == _ShardState.LOCAL

            self._walk(it, "prepare_index", prepare)

        def _ready_thread(self, it) -> None:
            def ready(shard_id: int) -> bool:
                if self._shard_states[shard_id] == _ShardState.REMOTE:
                    self.prepare_shard(shard_id, False)
                while self._shard_states[shard_id] != _ShardState.LOCAL and not self._event.is_set():
                    sleep(_POLL_S)
                return True

            self._walk(it, "ready_index", ready)

        def _walk(self, it, index: str, visit: Callable[[int], bool]) -> None:
            """Streaming's download and ready threads, a chunk of sample ids at a time: ``visit`` each
            shard once per epoch (streaming calls ``prepare_shard``, which takes a file lock, per
            sample). ``predownload`` still bounds how far ahead of the yield loop a shard not visited
            yet is visited; shards already visited are passed over without waiting."""
            done: set[int] = set()  # without a cache limit nothing evicts a local shard
            while not it.should_exit() and not self._event.is_set():
                at = getattr(it, index)
                if at == it.total or (index == "prepare_index" and it.ready_index == it.total):
                    setattr(it, index, it.total)
                    break
                end = min(it.total, at + _PREPARE_CHUNK)
                chunk = it.sample_ids[at:end]
                valid = np.flatnonzero(chunk != -1)
                shards = np.searchsorted(self.sample_offset_per_shard, chunk[valid], side="right") - 1
                unique, first = np.unique(shards, return_index=True)
                order = np.argsort(first)
                limit = it.total if self.predownload is None else it.yield_index + self.predownload + 1
                for shard_id, pos in zip(unique[order].tolist(), valid[first[order]].tolist()):
                    if shard_id in done:
                        continue
                    if at + pos >= limit:  # too far ahead: wait for the yield loop
                        end = at + pos
                        break
                    if visit(shard_id) and not self.cache_limit:
                        done.add(shard_id)
                if end == at:
                    sleep(TICK)
                setattr(it, index, end)
            it.on_exit()

        def _reader(self) -> _ShardReader | None:
            # One per process: loader workers (forked or spawned) map the shards themselves.
            cached = self.__dict__.get("_batch_reader")
            if cached is None or cached[0] != os.getpid():
                layouts = {(tuple(s.column_names), tuple(s.column_encodings), tuple(s.column_sizes))
                           if hasattr(s, "column_encodings") else None for s in self.shards}
                reader = None
                if len(layouts) == 1 and None not in layouts:  # one MDS layout throughout
                    paths = [os.path.join(s.dirname, s.split, s.raw_data.basename) for s in self.shards]
                    reader = _ShardReader(_Layout(*map(list, layouts.pop())), paths, self.sample_offset_per_shard,
                                          self.prepare_shard)
                cached = self.__dict__["_batch_reader"] = (os.getpid(), reader)
            return cached[1]

        def read_batch(self, sample_ids: np.ndarray) -> dict[str, Any]:
            """The samples ``sample_ids`` (global ids, their shards local) as decoded columns."""
            reader = self._reader()
            if reader is None:  # not one MDS layout: streaming decodes each sample
                samples = [self.get_item(int(i)) for i in sample_ids]
                return decode_columns(samples, list(samples[0]) if samples else [])
            return reader.read(sample_ids)

        def read_all(self, columns: list[str] | None = None, chunk: int = 65_536) -> dict[str, Any]:
            """Every sample, in order, as decoded columns (``columns`` picks and orders them)."""
            for shard_id in range(len(self.shards)):
                self.prepare_shard(shard_id)
            parts = [self.read_batch(np.arange(at, min(at + chunk, self.num_samples)))
                     for at in range(0, self.num_samples, chunk)]
            names = columns or (list(parts[0]) if parts else [])
            return {c: _concat([p[c] for p in parts]) for c in names}

    class BatchLoader(StreamingDataLoader):
        """A ``StreamingDataLoader`` over a ``BatchDataset``: each item is a whole batch, passed through
        ``transform`` (in the worker, with ``num_workers``); ``state_dict`` counts the samples delivered."""

        def __init__(self, dataset, *, num_workers: int = 0, transform: Callable[[dict[str, Any]], Any],
                     generator=None, **kwargs):
            super().__init__(dataset, batch_size=None, num_workers=num_workers, collate_fn=_Apply(transform),
                             generator=generator, **kwargs)

        def __iter__(self):
            self.num_samples_yielded = 0
            for count, batch in DataLoader.__iter__(self):
                self.num_samples_yielded += count
                yield batch

        def __len__(self) -> int:
            """Batches in this rank's share of the epoch."""
            return -(-len(self.dataset) // self.dataset.batch_size)

    for cls in (BatchDataset, BatchLoader):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    globals()["_BATCH_CLASSES"] = {"BatchDataset": BatchDataset, "BatchLoader": BatchLoader}
    return globals()["_BATCH_CLASSES"]
