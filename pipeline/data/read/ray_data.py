"""Ray Data as the training split's reader (``data.reader = ray``, with ``launch.kind = ray``).

Ray Data has no MDS reader: the dataset is the published version's row ranges (``ray.data.from_items``, no
read tasks to schedule), read by Ray Data tasks (``read_rows``) from the version's MDS shards with the same
decoder as the default reader (so the same columns and checks), each worker process opening the split
once and keeping it for the next epochs. A split whose decoded rows fit in ``MATERIALIZE_FRACTION`` of the
cluster's object store is read once and kept there (``materialize``): each later epoch streams its blocks from
memory instead of reading and decoding the shards again, and the epochs start without waiting for read tasks
(``bench/ray_vs_torchrun.py``: 0.56x of torchrun's samples/s read every epoch, 0.79x kept). Rank 0 splits it
across the workers once
(``streaming_split(equal=True)``: every rank gets the same number of rows) and hands each rank its
iterator; batches come from ``iter_torch_batches`` with the recipe's transform as ``collate_fn``.

Shuffling: the ranges' order (by ``train.seed``) and Ray's local shuffle buffer, different every epoch; a mid-epoch
resume skips the batches already trained on (the samples of this epoch's rest are not the same ones an
uninterrupted run would have seen: Ray Data does not replay an order). The validation and test splits
stay on the MDS reader.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pipeline.errors import ConfigError

ROWS_PER_READ = 1024
READER_CPUS = 0.25  # the reading actor's reservation: training workers hold the rest of a small node
SHUFFLE_BUFFER_BATCHES = 4
MATERIALIZE_FRACTION = 0.25  # of the cluster's object store: a split that fits is read once, not every epoch


@functools.lru_cache(maxsize=4)
def _split_reader(dirs: tuple[str, ...], split: str, cache_dir: str):
    """A split's MDS reader, opened once per Ray worker process (Ray keeps them warm between epochs); the
    node's reading processes share one cache, where each shard is made local once."""
    from pipeline.data.read.training_data import TrainingData

    return TrainingData.open(list(dirs), Path(cache_dir)).shards(split)


def read_rows(batch: dict[str, np.ndarray], *, dirs: tuple[str, ...], split: str, cache_dir: str) -> dict[str, np.ndarray]:
    """Ray Data's map: row ranges -> those rows' decoded columns."""
    ids = np.concatenate([np.arange(a, b) for a, b in zip(batch["start"], batch["stop"])])
    columns = _split_reader(dirs, split, cache_dir).read(ids)
    return {name: np.asarray(values) for name, values in columns.items()}


def collate(transform: Callable[[dict[str, Any]], Any]):
    """The recipe's batch transform as Ray Data's collate function (numpy columns in, tensors out)."""
    from ray.data.collate_fn import NumpyBatchCollateFn

    class Collate(NumpyBatchCollateFn):
        def __call__(self, batch: dict[str, np.ndarray]) -> Any:
            return transform(batch)

    return Collate()


class RowCount:
    """What the loop asks of ``loader.dataset``: this rank's rows."""

    def __init__(self, rows: int):
        self.rows = rows

    def __len__(self) -> int:
        return self.rows


class RayDataLoader:
    """One rank's Ray Data iterator as the loop's loader: iteration, ``dataset`` (its rows), and a position
    (``state_dict``: samples of the epoch delivered, over all ranks, so that a resume with another number
    of workers starts at the same share of the epoch)."""

    def __init__(self, iterator, *, rows: int, world_size: int, batch_size: int, shuffle: bool, seed: int,
                 transform: Callable[[dict[str, Any]], Any]):
        self.iterator, self.dataset, self.world_size = iterator, RowCount(rows), world_size
        self.batch_size, self.shuffle, self.seed, self.transform = batch_size, shuffle, seed, transform
        self.epoch, self._delivered, self._skip = 0, 0, 0

    def __iter__(self):
        skip, self._skip, self._delivered = self._skip, 0, 0
        shuffle = {"local_shuffle_buffer_size": self.batch_size * SHUFFLE_BUFFER_BATCHES,
                   "local_shuffle_seed": self.seed + self.epoch} if self.shuffle else {}
        self.epoch += 1
        for i, batch in enumerate(self.iterator.iter_torch_batches(batch_size=self.batch_size,
                                                                   collate_fn=collate(self.transform), **shuffle)):
            if i < skip:
                continue
            self._delivered = (i + 1) * self.batch_size
            yield batch

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch - 1, "sample_in_epoch": self._delivered * self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state.get("epoch", 0))
        self._skip = int(state.get("sample_in_epoch", 0)) // self.world_size // self.batch_size


def ray_loader(data, split: str, *, batch_size: int, shuffle: bool, seed: int,
               transform: Callable[[dict[str, Any]], Any]) -> RayDataLoader:
    """This rank's share of ``split`` through Ray Data (every rank calls it, in the same order)."""
    import ray
    import torch.distributed as dist

    if not ray.is_initialized():
        raise ConfigError("data.reader=ray reads through Ray Data inside a Ray job: it needs launch.kind=ray "
                          "(or data.reader=mds)")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    rows = data.rows(split)
    iterators = None
    if rank == 0:
        ray.data.DataContext.get_current().enable_progress_bars = False  # a bar redrawn per second, in the task log
        ranges = [{"start": at, "stop": min(at + ROWS_PER_READ, rows)} for at in range(0, rows, ROWS_PER_READ)]
        if shuffle:  # the ranges' order; the rows within a few batches are shuffled again in every epoch
            ranges = [ranges[i] for i in np.random.default_rng(seed).permutation(len(ranges))]
        dataset = ray.data.from_items(ranges, override_num_blocks=len(ranges)).map_batches(
            read_rows, fn_kwargs={"dirs": tuple(str(d) for d in data.dirs), "split": split,
                                  "cache_dir": str(data.cache_dir / "ray")},
            batch_size=1, batch_format="numpy", num_cpus=READER_CPUS)
        if _fits_in_object_store(data, split, rows):
            dataset = dataset.materialize()
        iterators = dataset.streaming_split(world, equal=True)
    if world > 1:
        holder = [iterators]
        dist.broadcast_object_list(holder, src=0)
        iterators = holder[0]
    return RayDataLoader(iterators[rank], rows=rows // world, world_size=world, batch_size=batch_size,
                         shuffle=shuffle, seed=seed, transform=transform)


def _fits_in_object_store(data, split: str, rows: int) -> bool:
    """Whether ``split``'s decoded rows (the first row's bytes times the rows) fit in ``MATERIALIZE_FRACTION`` of
    the Ray cluster's object store."""
    import ray

    if rows == 0:
        return False
    first = data.shards(split).read(np.arange(1))
    row_bytes = sum(np.asarray(values).nbytes for values in first.values())
    store = ray.cluster_resources().get("object_store_memory", 0)
    return row_bytes * rows <= MATERIALIZE_FRACTION * store
