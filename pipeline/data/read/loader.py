"""Reading a split for training: this rank's share of every epoch, in whole batches, resumable mid-epoch.

The order is streaming's own, through its public functions, as a ``StreamingDataset`` with its defaults orders
the samples: the epoch's partition over nodes, ranks and loader workers is ``get_partitions`` (``relaxed``), its
shuffle ``get_shuffle`` (``py1e``), the world ``streaming.base.world.World``, and the loader's position is
streaming's ``state_dict`` (epoch, sample in epoch, canonical nodes, seed, initial nodes), so that a run resumes
at the exact sample, on the same or another number of ranks. A shard reaches the node's cache through
``Stream.prepare_shard`` (copied or downloaded, checked against the index's hash with ``validate_hash``,
decompressed); the index itself is checked against the version's manifest first.

What is our own is the reading (``bench/loader.py`` measures it beside streaming's per-sample path): a batch is
read as one piece from memory-mapped shards and decoded by column (``pipeline.data.read.shards``), where streaming's
``__getitem__`` opens and decodes every sample on its own; and each rank (each loader worker) works out its own
share, so no shared memory, registration or barrier is needed between the ranks of a node.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from torch.utils.data import IterableDataset

from pipeline import storage
from pipeline.data.read.ahead import ReadAhead
from pipeline.data.read.shards import Layout, ShardReader, concat
from pipeline.data.versions import integrity
from pipeline.errors import DataError

log = logging.getLogger(__name__)

PARTITION_ALGO, SHUFFLE_ALGO = "relaxed", "py1e"  # StreamingDataset's defaults: the same order as streaming's
AHEAD = 2  # batches read ahead of the training step, on a thread (``pipeline.data.read.ahead.ReadAhead``)
DOWNLOADS = 4  # shards downloaded side by side from an object store (Shards.download_ahead)


@dataclass(frozen=True)
class Source:
    """One dataset version's split: where its files are (a folder, or an object-store URI that streaming's
    downloader reads), what its manifest vouches for, where they are cached on this node."""

    dataset_dir: Path | str
    manifest: dict[str, Any]
    split: str
    cache_dir: Path

    @property
    def remote(self) -> str:
        return storage.join(self.dataset_dir, self.split)

    def describe(self, basename: str) -> str:
        return (f"dataset {self.manifest['name']} version {self.manifest['version']}, split {self.split}, "
                f"shard {basename}")


class Shards:
    """Every shard of one split over one or more versions, in order, made local on first use: one process's view
    (the readers' memory maps are its own)."""

    def __init__(self, sources: list[Source]):
        from streaming import Stream
        from streaming.base.format import reader_from_json

        self.sources = sources
        self.streams, self.readers, self.source_of = [], [], []
        for k, source in enumerate(sources):
            entries = _verified_index(source)
            algo = _hash_of(entries)
            stream = Stream(remote=source.remote, local=str(source.cache_dir), download_retry=2,
                            download_timeout=600, validate_hash=algo, keep_zip=False)
            self.streams.append(stream)
            for entry in entries:
                self.readers.append(reader_from_json(str(source.cache_dir), "", entry))
                self.source_of.append(k)
        self.samples_per_shard = np.array([r.samples for r in self.readers], np.int64)
        self.first_sample = np.concatenate([[0], np.cumsum(self.samples_per_shard)[:-1]]).astype(np.int64)
        self.num_samples = int(self.samples_per_shard.sum())
        layouts = {(tuple(r.column_names), tuple(r.column_encodings), tuple(r.column_sizes)) for r in self.readers}
        if len(layouts) > 1:
            raise DataError(f"{[str(s.dataset_dir) for s in sources]}: split {sources[0].split} has shards of "
                            f"{len(layouts)} different column layouts; a window reads versions of one schema")
        self.layout = Layout(*map(list, layouts.pop())) if layouts else None
        self._ready: set[int] = set()
        self._reader: tuple[int, ShardReader] | None = None

    def prepare(self, shard_id: int) -> None:
        """Shard ``shard_id``'s raw file in the cache, checked: once per process, one process at a time per file."""
        if shard_id in self._ready:
            return
        reader, source = self.readers[shard_id], self.sources[self.source_of[shard_id]]
        raw = source.cache_dir / reader.raw_data.basename
        done = raw.with_name(f".{raw.name}.ok")  # written after the checked file: a crash leaves no half file "ready"
        raw.parent.mkdir(parents=True, exist_ok=True)
        with _locked(raw.with_name(f".{raw.name}.lock")):
            if not done.exists():
                raw.unlink(missing_ok=True)
                try:
                    self.streams[self.source_of[shard_id]].prepare_shard(reader)
                except ValueError as exc:  # streaming's "Checksum failure": the shard is not what its index says
                    raise self._damaged(shard_id, exc) from None
                done.touch()
        self._ready.add(shard_id)

    def download_ahead(self, sample_ids: np.ndarray) -> threading.Event:
        """On an object store, bring the shards of ``sample_ids`` into the cache on ``DOWNLOADS`` threads, in the
        order the samples first need them, while the batches before them train (streaming's own dataset
        downloads ahead too): the first epoch waits on a download only when it outruns them. Set the returned
        event to stop them. An error is left for the reader to raise when it needs that shard."""
        stop = threading.Event()
        if not any(storage.is_remote(source.dataset_dir) for source in self.sources):
            return stop
        shards = np.searchsorted(self.first_sample, sample_ids, side="right") - 1
        _, first = np.unique(shards, return_index=True)
        order = iter([int(shard) for shard in shards[np.sort(first)] if int(shard) not in self._ready])
        lock = threading.Lock()

        def run() -> None:
            while not stop.is_set():
                with lock:
                    shard = next(order, None)
                if shard is None:
                    return
                try:
                    self.prepare(shard)
                except Exception:  # noqa: BLE001 - the reader meets it again, and raises it, at that shard
                    return

        def start() -> None:
            first = next(order, None)  # alone: its download makes the store's client the others share
            if first is not None:
                with contextlib.suppress(Exception):
                    self.prepare(first)
            for i in range(1, DOWNLOADS):
                threading.Thread(target=run, name=f"shards-ahead-{i}", daemon=True).start()
            run()

        threading.Thread(target=start, name="shards-ahead-0", daemon=True).start()
        return stop

    def reader(self) -> ShardReader:
        # One per process: loader workers (forked) map the shards themselves.
        if self._reader is None or self._reader[0] != os.getpid():
            paths = [str(self.sources[k].cache_dir / r.raw_data.basename) for r, k in zip(self.readers, self.source_of)]
            names = [self.sources[k].describe((r.zip_data or r.raw_data).basename)
                     for r, k in zip(self.readers, self.source_of)]
            self._reader = (os.getpid(), ShardReader(self.layout, paths, self.first_sample, self.prepare, names))
        return self._reader[1]

    def read(self, sample_ids: np.ndarray) -> dict[str, Any]:
        """The samples ``sample_ids`` (global ids over the split's shards) as decoded columns."""
        return self.reader().read(sample_ids)

    def read_all(self, columns: list[str] | None = None, chunk: int = 65_536) -> dict[str, Any]:
        """Every sample, in order, as decoded columns (``columns`` picks and orders them)."""
        parts = [self.read(np.arange(at, min(at + chunk, self.num_samples)))
                 for at in range(0, self.num_samples, chunk)]
        names = columns or (list(parts[0]) if parts else [])
        return {c: concat([p[c] for p in parts]) for c in names}

    def _damaged(self, shard_id: int, error: ValueError) -> DataError:
        reader, source = self.readers[shard_id], self.sources[self.source_of[shard_id]]
        for info in (reader.zip_data, reader.raw_data):
            if info is not None:
                (source.cache_dir / info.basename).unlink(missing_ok=True)
        basename = (reader.zip_data or reader.raw_data).basename
        entry = integrity.expected_files(source.manifest, source.split).get(basename)
        damage = integrity.check_file(storage.join(source.remote, basename), entry, source.split) if entry else None
        if damage is None:  # the version's file is sound: its copy in the cache was not
            damage = integrity.Damage(source.split, basename, "the index's hash", f"a copy that did not match ({error})")
        return integrity.damaged_error(source.dataset_dir, source.manifest, [damage])


class Epochs:
    """The order of every epoch of one split, as streaming orders it, and this loader's position in it."""

    def __init__(self, samples_per_shard: np.ndarray, *, batch_size: int, shuffle: bool, seed: int):
        self.samples_per_shard, self.batch_size, self.shuffle, self.seed = samples_per_shard, batch_size, shuffle, seed
        self.num_samples = int(samples_per_shard.sum())
        self.num_canonical_nodes: int | None = None
        self.initial_physical_nodes: int | None = None
        self.next_epoch = 0
        self._resume: dict[str, Any] | None = None

    def begin(self, world) -> tuple[int, int]:
        """The epoch an iteration starts and the sample it starts at (a resumed position once, else 0)."""
        state, self._resume = self._resume, None
        if state is not None and state["epoch"] >= self.next_epoch:
            epoch, offset = int(state["epoch"]), int(state["sample_in_epoch"])
            self.num_canonical_nodes, self.seed = int(state["num_canonical_nodes"]), int(state["shuffle_seed"])
            self.initial_physical_nodes = state.get("initial_physical_nodes")
        else:
            epoch, offset = self.next_epoch, 0
        if self.num_canonical_nodes is None:
            self.num_canonical_nodes = world.num_nodes  # streaming's default for py1e
        self.next_epoch = epoch + 1
        return epoch, offset

    def work(self, world, epoch: int, offset: int) -> np.ndarray:
        """This worker's sample ids of ``epoch`` from global sample ``offset`` on, padding (-1) dropped."""
        from streaming.base.partition import get_partitions
        from streaming.base.shuffle import get_shuffle

        ids = get_partitions(PARTITION_ALGO, self.num_samples, self.num_canonical_nodes, world.num_nodes,
                             world.ranks_per_node, world.workers_per_rank, self.batch_size, offset,
                             self.initial_physical_nodes)
        if self.shuffle:
            block = max(4_000_000 // self.num_canonical_nodes, 1 << 18)  # streaming's default shuffle_block_size
            order = get_shuffle(SHUFFLE_ALGO, self.samples_per_shard, self.num_canonical_nodes, self.seed, epoch, block)
            ids = np.where(ids != -1, order[ids], -1)
        mine = ids[world.node, world.rank_of_node, world.worker_of_rank].reshape(-1)
        return mine[mine != -1]

    def state(self, epoch: int, sample_in_epoch: int, world) -> dict[str, Any]:
        return {"epoch": epoch, "sample_in_epoch": sample_in_epoch, "num_canonical_nodes": self.num_canonical_nodes,
                "shuffle_seed": self.seed,
                "initial_physical_nodes": self.initial_physical_nodes or world.num_nodes}

    def resume(self, state: dict[str, Any]) -> None:
        self._resume = dict(state)


class BatchStream(IterableDataset):
    """A torch ``IterableDataset`` of ``(count, columns)``: this worker's batches of the epoch its loader began."""

    def __init__(self, shards: Shards, epochs: Epochs):
        self.shards, self.epochs = shards, epochs
        self.epoch, self.offset = 0, 0

    def __len__(self) -> int:
        """Samples in this rank's share of an epoch (what ``StreamingDataset`` says)."""
        from streaming.base.world import World

        return -(-self.shards.num_samples // World.detect().num_ranks)

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        from streaming.base.world import World

        world = World.detect()  # in a loader worker, with its worker
        ids = self.epochs.work(world, self.epoch, self.offset)
        size = self.epochs.batch_size
        ahead = self.shards.download_ahead(ids)
        try:
            for at in range(0, len(ids), size):
                batch = ids[at:at + size]
                yield len(batch), self.shards.read(batch)
        finally:
            ahead.set()


class BatchLoader:
    """Whole batches of one split for this rank, each passed through ``transform``; ``state_dict`` and
    ``load_state_dict`` give the mid-epoch position (streaming's format). With ``num_workers`` a torch
    ``DataLoader``'s workers read; without, a thread reads and transforms up to ``AHEAD`` batches ahead."""

    def __init__(self, shards: Shards, *, batch_size: int, shuffle: bool, seed: int, num_workers: int = 0,
                 transform: Callable[[dict[str, Any]], Any], generator=None):
        self.dataset = BatchStream(shards, Epochs(shards.samples_per_shard, batch_size=batch_size, shuffle=shuffle,
                                                  seed=seed))
        self.num_workers, self.transform, self.generator = num_workers, transform, generator
        self.num_samples_yielded = 0

    def __iter__(self) -> Iterator[Any]:
        from streaming.base.world import World
        from torch.utils.data import DataLoader

        epochs = self.dataset.epochs
        self.dataset.epoch, self.dataset.offset = epochs.begin(World.detect())
        self.num_samples_yielded = 0
        if self.num_workers:
            # Workers are forked at each iteration: they take the epoch and position set above.
            batches = iter(DataLoader(self.dataset, batch_size=None, num_workers=self.num_workers,
                                      collate_fn=_Apply(self.transform), generator=self.generator))
        else:
            batches = ReadAhead(map(_Apply(self.transform), self.dataset), AHEAD)
        return self._counted(batches)

    def _counted(self, batches: Iterable[tuple[int, Any]]) -> Iterator[Any]:
        for count, batch in batches:
            self.num_samples_yielded += count  # what the caller has taken: a checkpoint resumes after it
            yield batch

    def __len__(self) -> int:
        """Batches in this rank's share of the epoch."""
        return -(-len(self.dataset) // self.dataset.epochs.batch_size)

    def state_dict(self) -> dict[str, Any]:
        from streaming.base.world import World

        world = World.detect()
        sample_in_epoch = self.dataset.offset + self.num_samples_yielded * world.num_ranks
        return self.dataset.epochs.state(self.dataset.epoch, sample_in_epoch, world)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.epochs.resume(state)


class _Apply:
    """Picklable: ``(count, columns)`` -> ``(count, transform(columns))``."""

    def __init__(self, transform: Callable[[dict[str, Any]], Any]):
        self.transform = transform

    def __call__(self, item: tuple[int, dict[str, Any]]) -> tuple[int, Any]:
        count, columns = item
        return count, self.transform(columns)


def _verified_index(source: Source) -> list[dict[str, Any]]:
    """The split's shard entries from its ``index.json``, whose digest the manifest vouches for."""
    entry = integrity.expected_files(source.manifest, source.split).get(integrity.INDEX)
    try:
        data = storage.read_bytes(storage.join(source.remote, integrity.INDEX))  # read once, checked, then parsed
    except FileNotFoundError:
        raise integrity.damaged_error(source.dataset_dir, source.manifest,
                                      [integrity.Damage(source.split, integrity.INDEX, "the file", "missing")]) from None
    damage = integrity.check_bytes(data, entry, source.split) if entry else None
    if damage is not None:
        raise integrity.damaged_error(source.dataset_dir, source.manifest, [damage])
    return json.loads(data)["shards"]


def _hash_of(entries: list[dict[str, Any]]) -> str | None:
    """The digest every shard file of the index records, that ``validate_hash`` checks (newest first)."""
    for algo in (integrity.ALGORITHM, "xxh64"):
        if all(algo in (e.get("zip_data") or e["raw_data"]).get("hashes", {}) for e in entries):
            return algo
    return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
