"""Small input files of every source format, and a reader of published versions, for the data tests."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import DataConfig


def cfg(path, **overrides) -> DataConfig:
    """A config with tiny shards (many of them) and tiny work units (many parts: ~100 rows of ``table``)."""
    defaults = dict(input_path=str(path), label_column="label", shard_size_limit_bytes=1 << 12, unit_bytes=2_000,
                    workers=1)
    return DataConfig(**{**defaults, **overrides})


def table(rows: int = 600, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({
        "a": rng.normal(size=rows),
        "b": rng.integers(0, 100, rows),
        "color": rng.choice(["red", "green", "blue"], rows),
        "label": rng.choice(["cat", "dog"], rows),
    })


def eight_bad_rows() -> pa.Table:
    """``table()`` with 8 bad rows: NaN in ``a`` at rows 3, 50, 51, 300, 599 and the label ``bird`` at 10, 20, 30."""
    t = table()
    a = t.column("a").to_numpy().copy()
    a[[3, 50, 51, 300, 599]] = np.nan
    labels = t.column("label").to_pylist()
    for i in (10, 20, 30):
        labels[i] = "bird"
    return t.set_column(0, "a", pa.array(a)).set_column(3, "label", pa.array(labels))


def write_parquet(path: Path, t: pa.Table, row_group_size: int = 100) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(t, path, row_group_size=row_group_size)
    return path


def image_bytes(array: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt)
    return out.getvalue()


def write_image_folder(root: Path, per_class: dict[str, int], *, seed: int = 0, fmt: str = "PNG") -> dict[str, np.ndarray]:
    """CLASS/NNN.png (or .jpg) files of random 8x8 grey images; returns relpath -> pixels."""
    rng = np.random.default_rng(seed)
    written = {}
    for label, count in per_class.items():
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = rng.integers(0, 256, (8, 8), dtype=np.uint8)
            name = f"{label}/{i:03d}.{'png' if fmt == 'PNG' else 'jpg'}"
            (root / name).write_bytes(image_bytes(pixels, fmt))
            written[name] = pixels
    return written


def dataset_dir(manifest: dict) -> Path:
    from pipeline.data import local_path

    return local_path(manifest["uri"])


def read_rows(manifest: dict, cache: Path, split: str | None = None) -> list[dict]:
    """Every sample of a published version (or one split), read back through StreamingDataset."""
    from streaming import StreamingDataset

    from tests.streaming_shm import registering

    rows = []
    for s in [split] if split else ["train", "val", "test"]:
        if not manifest["splits"][s]:
            continue
        with registering():
            ds = StreamingDataset(remote=str(dataset_dir(manifest) / s), local=str(cache / manifest["version"] / s),
                                  shuffle=False)
        rows += [dict(ds[i], _split=s) for i in range(ds.num_samples)]
    return rows


def published(out: Path) -> list[Path]:
    """Version folders a reader would see (temporary ones start with a dot)."""
    return sorted(p for p in out.rglob("manifest.json") if not any(part.startswith(".") for part in p.parent.parts[-1:]))


def _png(width: int, height: int, rows: bytes) -> bytes:
    """A gray 8-bit PNG of ``width`` x ``height`` whose image data is ``rows`` (filter byte + pixels per row)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def png_bad_filter() -> bytes:
    """A PNG whose every chunk checks out but whose scanlines name filter type 7, which does not exist: the
    damage libpng reports as "bad adaptive filter value" (torchvision's decode_png crashed the process on it)."""
    return _png(64, 64, (b"\x07" + bytes(64)) * 64)


def png_bomb(side: int = 30_000) -> bytes:
    """A PNG of a few hundred bytes whose header claims ``side`` x ``side`` pixels (a decompression bomb)."""
    return _png(side, side, b"\x00" + bytes(side))


def open_datasets_in_step(uri: str, cache: str, barrier, rounds: int, results) -> None:
    """A job of its own (run in a process of its own): opens ``uri``'s train split ``rounds`` times, each at the
    moment ``barrier`` lets every such job go, keeping every dataset open; puts (errors, prefixes) in
    ``results``."""
    from pipeline.data.read.training_data import TrainingData

    keep, errors = [], []
    for i in range(rounds):
        data = TrainingData.open([uri], Path(cache) / str(i))
        barrier.wait()
        try:
            keep.append(streaming_dataset(data, Path(cache) / f"ref-{i}", "train"))
        except Exception as exc:  # noqa: BLE001 - what the test reports
            errors.append(f"{type(exc).__name__}: {exc}")
    results.put((errors, [d._shm_prefix_int for d in keep]))
    barrier.wait()  # every job's datasets still open until all have reported


def numbered_rows(tmp: Path, rows: int = 700) -> dict:
    """The manifest of a published version of ``table`` with an ``id`` column (0, 1, ...), in tiny shards: many
    of them."""
    from pipeline.data.prepare.version import prepare

    write_parquet(tmp / "in.parquet", table(rows).append_column("id", pa.array(np.arange(rows))))
    return prepare(cfg(tmp / "in.parquet"), name="t", out_root=tmp / "out")


def as_columns(columns):
    return columns  # the identity transform: batches as decoded columns (module level: picklable)


def assert_same_batches(fast: list[dict], slow: list[dict]) -> None:
    assert len(fast) == len(slow)
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert list(a) == list(b), f"batch {i}: columns {list(a)} != {list(b)}"
        for name in a:
            x, y = a[name], b[name]
            assert (x.dtype, x.shape) == (y.dtype, y.shape), \
                f"batch {i} column {name}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
            assert np.array_equal(x, y), f"batch {i} column {name} differs"


def both_paths(data, tmp_path: Path, split: str = "train", **kwargs) -> tuple[list[dict], list[dict]]:
    """Every batch of one epoch of ``data`` (a TrainingData) through the batch path and through the per-sample
    path."""
    fast = list(data.loader(split, transform=as_columns, **kwargs))
    slow = list(streaming_loader(data, tmp_path / "slow-cache", split, transform=as_columns, **kwargs))
    return fast, slow


def streaming_loader(data, cache: Path, split: str, *, batch_size: int, shuffle: bool, seed: int,
                     num_workers: int = 0, transform):
    """The reference the batch path is held to: streaming's own ``StreamingDataset`` over the same versions'
    split (one stream each), its ``StreamingDataLoader``, each sample decoded by ``__getitem__``, then stacked by
    ``decode_columns``: the same batches, in the same order, several times slower."""
    import torch
    from streaming import StreamingDataLoader

    dataset = streaming_dataset(data, cache, split, shuffle=shuffle, seed=seed, batch_size=batch_size)
    return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                               collate_fn=_Collate(transform), generator=torch.Generator().manual_seed(seed))


def streaming_dataset(data, cache: Path, split: str, *, shuffle: bool = False, seed: int = 0,
                      batch_size: int | None = None):
    """streaming's ``StreamingDataset`` over ``data``'s versions of ``split``, one stream each (its defaults)."""
    from streaming import Stream, StreamingDataset

    from tests.streaming_shm import registering

    streams = [Stream(remote=str(d / split), local=str(cache / m["version"] / split))
               for d, m in zip(data.dirs, data.manifests) if m["splits"][split]]
    with registering():  # another lane of the suite may be opening one at this moment
        return StreamingDataset(streams=streams, shuffle=shuffle, shuffle_seed=seed, batch_size=batch_size)


class _Collate:
    """Picklable collate: decode the batch's columns, then the transform."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, samples: list[dict]):
        from pipeline.data.read.shards import decode_columns

        return self.transform(decode_columns(samples, list(samples[0]) if samples else []))


def _ids_of(columns):
    return columns["id"].tolist()  # not a dict of arrays: the loader counts samples itself


def check_mid_epoch_resume(manifest: dict, tmp_path: Path, num_workers: int) -> None:
    """A loader over ``numbered_rows``'s train split stopped after 7 batches and resumed from its state in a
    fresh loader delivers exactly the remaining samples, in the uninterrupted epoch's order."""
    from pipeline.data.read.training_data import TrainingData

    def ids(batches) -> list[int]:
        return [int(i) for b in batches for i in b]

    kwargs = dict(batch_size=16, shuffle=True, seed=5, transform=_ids_of, num_workers=num_workers)
    data = TrainingData.open([manifest["uri"]], tmp_path / "a")
    whole = list(data.loader("train", **kwargs))
    first = data.loader("train", **kwargs)
    taken = []
    for i, batch in enumerate(first):
        taken.append(batch)
        if i == 6:
            break
    state = first.state_dict()
    assert state["sample_in_epoch"] == 7 * 16

    again = TrainingData.open([manifest["uri"]], tmp_path / "b").loader("train", **kwargs)
    again.load_state_dict(state)
    rest = list(again)
    assert ids(taken) + ids(rest) == ids(whole)  # none missing, none twice, in the same order
    assert len(set(ids(whole))) == manifest["splits"]["train"]
