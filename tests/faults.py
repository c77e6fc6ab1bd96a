"""Fault injection at a chosen moment of a real training job."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from pipeline.job_files import read_heartbeats


def when_checkpoint(out: Path, action, min_step: int, timeout_s: float = 120,
                    steps: Callable[[], list[int]] | None = None) -> threading.Thread:
    """Run ``action(heartbeats)`` as soon as a checkpoint of at least ``min_step`` exists under ``out`` (or among
    ``steps()``: the complete ones of a store elsewhere)."""

    def watch():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = steps() if steps else [int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*")]
            if found and max(found) >= min_step:
                action(read_heartbeats(out / "progress"))
                return
            time.sleep(0.2 if steps else 0.01)  # a store's listing is a request

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def sigkill_rank(rank: int, killed: dict):
    """An action for ``when_checkpoint``: SIGKILL ``rank``'s process, its pid noted in ``killed``."""

    def kill(beats) -> None:
        killed["pid"] = beats[rank]["pid"]
        os.kill(beats[rank]["pid"], signal.SIGKILL)

    return kill
