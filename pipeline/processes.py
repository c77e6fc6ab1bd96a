"""What /proc says about processes: alive or not, and who descends from whom (Linux)."""

from __future__ import annotations

import os


def stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of ``pid``, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in brackets may hold spaces
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1]), int(fields[2])


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, does not count)."""
    found = stat(pid)
    return found is not None and found[0] != "Z"


def descendants(root: int) -> list[int]:
    """Live (non-zombie) descendants of ``root``, parents before children."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        found = stat(int(pid))
        if found and found[0] != "Z":
            children.setdefault(found[1], []).append(int(pid))
    result, queue = [], list(children.get(root, []))
    while queue:
        pid = queue.pop(0)
        result.append(pid)
        queue.extend(children.get(pid, []))
    return result
