"""Finding a test's processes by a marker on their command line (what must be gone after a stop)."""

from __future__ import annotations

import time

import psutil


def cmdline(pid: int) -> bytes:
    """The command line of ``pid`` as the kernel keeps it (arguments ended by NUL bytes); empty when
    the process is gone, a zombie or not ours to read."""
    try:
        return b"".join(arg.encode() + b"\0" for arg in psutil.Process(pid).cmdline())
    except psutil.Error:
        return b""


def pids_with(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker``."""
    return [p.pid for p in psutil.process_iter() if marker.encode() in cmdline(p.pid)]


def wait_until_gone(marker: str, timeout_s: float = 10) -> list[int]:
    """Wait up to ``timeout_s`` for every process with ``marker`` to end; return those still alive."""
    deadline = time.monotonic() + timeout_s
    while pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids_with(marker)


def parent(pid: int) -> int:
    return psutil.Process(pid).ppid()
