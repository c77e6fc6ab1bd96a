"""Finding a test's processes by a marker on their command line (what must be gone after a stop)."""

from __future__ import annotations

import os
import time

from pipeline.processes import stat


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def pids_with(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker``."""
    return [int(pid) for pid in filter(str.isdigit, os.listdir("/proc")) if marker.encode() in cmdline(int(pid))]


def wait_until_gone(marker: str, timeout_s: float = 10) -> list[int]:
    """Wait up to ``timeout_s`` for every process with ``marker`` to end; return those still alive."""
    deadline = time.monotonic() + timeout_s
    while pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids_with(marker)


def parent(pid: int) -> int:
    return stat(pid)[1]
