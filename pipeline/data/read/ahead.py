"""Reading ahead of the consumer on a thread: the next batches are read and transformed while the last one trains."""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterable, Iterator, TypeVar

T = TypeVar("T")
_END = object()  # ReadAhead's last entry


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
