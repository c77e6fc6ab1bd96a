"""``Phases``: how long each named phase of a stage took, for its result (``phases``) and its log line."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


class Phases:
    """``with phases("scoring"): ...`` adds the block's seconds to that phase; ``seconds`` keeps the phases in
    the order they began."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - began, 3)

    def total(self) -> float:
        return round(time.perf_counter() - self._started, 3)

    def line(self) -> str:
        """``4.1s: open data 0.6s, model logging 2.9s, ...``"""
        return f"{self.total():.1f}s: " + ", ".join(f"{name} {s:.1f}s" for name, s in self.seconds.items())
