"""BatchDataset and BatchLoader: mosaicml-streaming 0.13's sample iterator, adapted to yield whole batches.

Copied from streaming 0.13.0 (``streaming/base/dataset.py``, pinned in requirements.txt):
``StreamingDataset.__iter__`` and the loops it runs, the download thread (``_prepare_thread``), the ready
thread (``_ready_thread``) and the yield loop (``_each_sample_id``), over streaming's private ``_Iterator``
and ``_ShardState``. Partition, shuffle, ``state_dict``/``load_state_dict`` and shard downloads stay
streaming's. It differs where streaming pays a cost per sample or per poll:

- the yield loop yields runs of ``batch_size`` sample ids, read as one piece from memory-mapped shards
  (``pipeline.data.shards``); streaming yields each sample through ``__getitem__``, which opens the shard
  file and decodes the sample on its own;
- the download and ready threads look at sample ids a chunk at a time and visit each shard once per
  epoch; streaming calls ``prepare_shard``, which takes a file lock, for every sample;
- waits poll every millisecond instead of streaming's 7 ms ``TICK``, the node barrier's own waits and its
  file lock too (filelock polls every 50 ms): those waits added tens of ms at each epoch start.

It is a copy of private code: a streaming upgrade must re-check it against ``StreamingDataset.__iter__``.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import numpy as np

from pipeline.data import integrity
from pipeline.data.shards import Layout, ShardReader, concat, decode_columns

AHEAD = 2  # batches read ahead of the training step, on a thread (ReadAhead)
_PREPARE_CHUNK = 8192  # sample ids the download threads look at per pass
_POLL_S = 0.001  # our waits for a shard or the ready thread (streaming's 7 ms tick added ~40 ms per epoch start)
_END = object()  # ReadAhead's last entry
T = TypeVar("T")


class _Apply:
    """Picklable: ``(count, columns)`` -> ``(count, transform(columns))``."""

    def __init__(self, transform: Callable[[dict[str, Any]], Any]):
        self.transform = transform

    def __call__(self, item: tuple[int, dict[str, Any]]) -> tuple[int, Any]:
        count, columns = item
        return count, self.transform(columns)


class ReadAhead:
    """``source``'s items, in order, taken by a thread up to ``depth`` items ahead of the consumer.

    The next batch is read and transformed while the last one trains: a step spends most of its time in
    torch's kernels and in the gradients' all-reduce, which release the interpreter lock. The thread starts
    at once, so the first batch is on its way before the first ``next``. An error of ``source`` is raised to
    the consumer at the item where it happened. ``close`` (or dropping the iterator: a preempted rank's
    ``del``) stops the thread after the item it is reading; only that thread ever runs ``source``."""

    def __init__(self, source: Iterable[T], depth: int):
        self._items: queue.Queue = queue.Queue(max(1, depth))
        self._stop = threading.Event()
        self._done = False
        threading.Thread(target=_produce, args=(iter(source), self._items, self._stop), name="read-ahead",
                         daemon=True).start()

    def __iter__(self) -> ReadAhead:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item, error = self._items.get()
        if item is _END:
            self._done = True
            self.close()
            if error is not None:
                raise error
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()

    __del__ = close


def _produce(source: Iterator[Any], items: queue.Queue, stop: threading.Event) -> None:
    """``ReadAhead``'s thread (it holds no reference to the ``ReadAhead``, so dropping that ends this)."""

    def put(entry) -> None:
        while not stop.is_set():
            try:
                items.put(entry, timeout=0.05)
                return
            except queue.Full:
                continue

    try:
        for item in source:
            put((item, None))
            if stop.is_set():
                return
        put((_END, None))
    except BaseException as error:  # raised again in the consumer, with its traceback
        put((_END, error))
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def __getattr__(name: str):
    # BatchDataset and BatchLoader subclass streaming's classes; importing streaming (and torch) is put off
    # until one is used, so that importing this module stays cheap. Pickle finds them here too.
    if name in ("BatchDataset", "BatchLoader", "VerifiedStream", "_Barrier"):
        return batch_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def batch_classes() -> dict[str, type]:
    if "_BATCH_CLASSES" in globals():
        return globals()["_BATCH_CLASSES"]
    import os
    from concurrent.futures import ThreadPoolExecutor, wait
    from threading import Event
    from time import sleep

    from filelock import FileLock
    from streaming import Stream, StreamingDataLoader, StreamingDataset
    from streaming.base.constant import TICK
    from streaming.base.dataset import _Iterator, _ShardState
    from streaming.base.shared.barrier import SharedBarrier
    from torch.utils.data import DataLoader

    class _Barrier(SharedBarrier):
        """Streaming's ``SharedBarrier.__call__`` (0.13), its waits polled every millisecond instead of every
        7 ms ``TICK``: the ranks meet in it three times at each epoch start (resume, share the epoch's
        partition, attach to it), which took 18-40 ms per epoch start, waiting for data."""

        def __call__(self, num_procs: int) -> None:
            with self.lock:
                if self.num_exit == -1:
                    self.num_exit = num_procs
            self.lock.acquire()
            if not self.num_enter:  # the first to arrive: wait for everyone to leave the last one
                self.lock.release()
                while self.num_exit != num_procs:
                    sleep(_POLL_S)
                self.lock.acquire()
                self.flag = False
            self.num_enter += 1
            if self.num_enter == num_procs:  # the last to arrive: "go"
                self.num_enter = 0
                self.num_exit = 0
                self.flag = True
            self.lock.release()
            while not self.flag:
                sleep(_POLL_S)
            with self.lock:
                self.num_exit += 1
                if self.num_exit == num_procs:
                    self.num_exit = -1

    class BatchDataset(StreamingDataset):
        """A ``StreamingDataset`` whose iteration yields ``(count, columns)`` per batch of ``batch_size``.

        The samples of each batch, and their order, are those a ``DataLoader(batch_size=batch_size)`` over
        the plain dataset puts in it: this worker's share of the epoch, ``-1`` padding skipped, cut into
        runs of ``batch_size``. Partition, shuffle, ``state_dict``/``load_state_dict`` and shard downloads
        are streaming's; its download threads here look at sample ids a chunk at a time and visit each
        shard once per epoch (streaming takes a file lock per sample), and samples are read by
        ``ShardReader`` (streaming opens the shard file and decodes each sample on its own).
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
            self._shared_barrier.__class__ = _Barrier
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
            for thread in (prepare, ready):
                # Streaming only logs a download thread's error and ends the epoch early: raise it here.
                if thread.done() and thread.exception() is not None:
                    raise thread.exception()

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

        def _reader(self) -> ShardReader | None:
            # One per process: loader workers (forked or spawned) map the shards themselves.
            cached = self.__dict__.get("_batch_reader")
            if cached is None or cached[0] != os.getpid():
                layouts = {(tuple(s.column_names), tuple(s.column_encodings), tuple(s.column_sizes))
                           if hasattr(s, "column_encodings") else None for s in self.shards}
                reader = None
                if len(layouts) == 1 and None not in layouts:  # one MDS layout throughout
                    paths = [os.path.join(s.dirname, s.split, s.raw_data.basename) for s in self.shards]
                    names = [self.streams[k].describe((s.zip_data or s.raw_data).basename)
                             if hasattr(self.streams[k], "describe") else path
                             for s, k, path in zip(self.shards, self.stream_per_shard.tolist(), paths)]
                    reader = ShardReader(Layout(*map(list, layouts.pop())), paths, self.sample_offset_per_shard,
                                         self.prepare_shard, names)
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
            return {c: concat([p[c] for p in parts]) for c in names}

    class BatchLoader(StreamingDataLoader):
        """A ``StreamingDataLoader`` over a ``BatchDataset``: each item is a whole batch, passed through
        ``transform`` (in the worker, with ``num_workers``); ``state_dict`` counts the samples delivered."""

        def __init__(self, dataset, *, num_workers: int = 0, transform: Callable[[dict[str, Any]], Any],
                     generator=None, **kwargs):
            super().__init__(dataset, batch_size=None, num_workers=num_workers, collate_fn=_Apply(transform),
                             generator=generator, **kwargs)

        def __iter__(self):
            """This epoch's batches. Without loader workers, a thread reads and transforms up to ``AHEAD``
            batches ahead of the caller from here on (``ReadAhead``); workers do that themselves."""
            self.num_samples_yielded = 0
            batches = DataLoader.__iter__(self)
            return self._counted(batches if self.num_workers else ReadAhead(batches, AHEAD))

        def _counted(self, batches):
            for count, batch in batches:
                self.num_samples_yielded += count  # what the caller has taken: a checkpoint resumes after it
                yield batch

        def __len__(self) -> int:
            """Batches in this rank's share of the epoch."""
            return -(-len(self.dataset) // self.dataset.batch_size)

    class VerifiedStream(Stream):
        """One split of a published version as a ``Stream`` whose files are checked against the version's
        manifest as they arrive in the local cache, before anything decompresses or decodes them."""

        def __init__(self, *, dataset_dir: str, manifest: dict[str, Any], split: str, local: str):
            super().__init__(remote=os.path.join(dataset_dir, split), local=local)
            self.dataset_dir, self.version_split = dataset_dir, split
            self.version = {"name": manifest["name"], "version": manifest["version"]}
            self.expected = integrity.expected_files(manifest, split)

        def describe(self, basename: str) -> str:
            return (f"dataset {self.version['name']} version {self.version['version']}, split {self.version_split}, "
                    f"shard {basename}")

        def _download_file(self, from_basename: str, to_basename: str | None = None) -> str:
            local = super()._download_file(from_basename, to_basename)
            entry = self.expected.get(from_basename)
            damage = integrity.check_file(Path(local), entry, self.version_split) if entry else None
            if damage is not None:
                os.remove(local)
                raise integrity.damaged_error(Path(self.dataset_dir), self.version, [damage])
            return local

    classes = {"BatchDataset": BatchDataset, "BatchLoader": BatchLoader, "VerifiedStream": VerifiedStream,
               "_Barrier": _Barrier}
    for cls in classes.values():
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    globals()["_BATCH_CLASSES"] = classes
    return globals()["_BATCH_CLASSES"]
