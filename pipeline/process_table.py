"""What the process table says (through psutil): alive or not, and who descends from whom."""

from __future__ import annotations

import os

import psutil


def stat(pid: int) -> tuple[str, int, int] | None:
    """(status, parent pid, process group) of ``pid``, or None when there is no such process; the
    status is psutil's (``psutil.STATUS_ZOMBIE``, ``STATUS_RUNNING``, ...)."""
    if pid <= 0:
        return None
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            return process.status(), process.ppid(), os.getpgid(pid)
    except (psutil.NoSuchProcess, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    found = stat(pid)
    return found is not None and found[0] != psutil.STATUS_ZOMBIE


def descendants(root: int) -> list[int]:
    """Live (non-zombie) descendants of ``root``, parents before children."""
    try:
        children = psutil.Process(root).children(recursive=True)  # each after its parent
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return out
