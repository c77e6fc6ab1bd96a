"""The one stopwatch: how long named phases took, and when this process first reached each one.

- ``lap(record)`` times a block and hands its seconds to ``record``; everything below times through it.
- ``Stopwatch``: seconds by phase for a stage's result (``phases``) and its log line
  (``with phases("scoring"): ...``); ``Throughput`` (``pipeline.train.throughput``) times the training loop's own
  work with ``lap`` too.
- ``mark``/``timeline``/``startup_line``: the Unix time this process reached each phase of a training run; rank 0's
  result carries it as ``timeline`` and ``bench/latency.py`` sets it beside the launch time.

Free of torch: a rank imports it before torch."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def lap(record: Callable[[float], None]) -> Iterator[None]:
    """``record(seconds)`` with the seconds the block took, even when it raises."""
    began = time.perf_counter()
    try:
        yield
    finally:
        record(time.perf_counter() - began)


class Stopwatch:
    """``with stopwatch("scoring"): ...`` adds the block's seconds to that phase; ``seconds`` keeps the phases in
    the order they began."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()

    def __call__(self, name: str) -> contextlib.AbstractContextManager[None]:
        return lap(lambda seconds: self.add(name, seconds))

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = round(self.seconds.get(name, 0.0) + seconds, 3)

    def total(self) -> float:
        return round(time.perf_counter() - self._started, 3)

    def line(self) -> str:
        """``4.1s: open data 0.6s, model logging 2.9s, ...``"""
        return f"{self.total():.1f}s: " + ", ".join(f"{name} {s:.1f}s" for name, s in self.seconds.items())


_MARKS: dict[str, float] = {}


def mark(phase: str) -> None:
    """Note the first time this process reached ``phase``."""
    _MARKS.setdefault(phase, time.time())


def timeline() -> dict[str, float]:
    """``{"process_start": ..., <phase>: ...}`` in the order the phases were reached."""
    import psutil

    return {"process_start": psutil.Process().create_time(), **_MARKS}


def startup_line() -> str:
    """``start-up 6.2s: imports done 2.7s, process group ready 0.2s, ...``: from the process start to the last phase
    reached, phase by phase."""
    marks = timeline()
    names = list(marks)
    parts = [f"{b.replace('_', ' ')} {marks[b] - marks[a]:.1f}s" for a, b in zip(names, names[1:])]
    return f"start-up {marks[names[-1]] - marks['process_start']:.1f}s: " + ", ".join(parts)
