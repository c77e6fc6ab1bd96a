"""When this process reached each phase of a training run, in Unix time: rank 0's result carries it as
``timeline`` (process start, imports done, process group ready, run context ready, data opened, model and data
ready, first step, last step, model saved), and the rank logs its start-up in one line. ``bench/latency.py``
sets it beside the launch time. Free of torch: it is imported before torch is."""

from __future__ import annotations

import time

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
