"""Per-rank heartbeats that the supervisor's stall watchdog reads, stack dumps on request, and the
preemption marker.

Each rank writes ``rank-R.json`` (pid, step, total, epoch, time) into ``PIPELINE_PROGRESS_DIR``,
at most every ``interval_s`` and at once on an epoch or checkpoint boundary. The files are
replaced atomically, so the reader never sees half a heartbeat. Any training script can use
this: call ``Heartbeat.from_env().beat(step)`` after each optimizer step.

When the ranks stop on SIGTERM (an eviction, a spot reclaim: ``pipeline.train.preemption``), rank 0
writes ``preempted.json`` there once the checkpoint of the step they agreed on is saved, and every rank
exits with ``PREEMPTED_EXIT_CODE``: the launcher restarts such an attempt, which resumes at that step.
This module stays free of torch: the launcher imports it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

PROGRESS_DIR_ENV = "PIPELINE_PROGRESS_DIR"
DUMP_SIGNAL = signal.SIGUSR1  # the supervisor sends it to every rank before stopping a stalled job
# EX_TEMPFAIL from sysexits.h: "try again later", which is what a preempted attempt asks for.
PREEMPTED_EXIT_CODE = 75
PREEMPTION_FILE = "preempted.json"


class Heartbeat:
    def __init__(self, directory: Path | None, rank: int, *, interval_s: float = 1.0):
        self.path = Path(directory) / f"rank-{rank}.json" if directory else None
        self.rank = rank
        self.interval_s = interval_s
        self._last_write = 0.0
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A stalled rank prints where it is stuck when the watchdog asks, without being stopped.
            faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
            self.beat(0, phase="starting", force=True)

    @classmethod
    def from_env(cls, rank: int | None = None) -> "Heartbeat":
        directory = os.environ.get(PROGRESS_DIR_ENV)
        return cls(Path(directory) if directory else None, int(os.environ.get("RANK", 0)) if rank is None else rank)

    def beat(self, step: int, *, total: int | None = None, epoch: int | None = None,
             phase: str = "training", force: bool = False) -> None:
        if not self.path:
            return
        now = time.time()
        if not force and now - self._last_write < self.interval_s:
            return
        self._last_write = now
        _write_atomically(self.path, {"rank": self.rank, "pid": os.getpid(), "step": step, "total": total,
                                      "epoch": epoch, "phase": phase, "time": now})


def read_heartbeats(directory: Path) -> dict[int, dict[str, Any]]:
    """The latest heartbeat of every rank, by rank (ranks that never wrote one are absent)."""
    beats = {}
    for path in Path(directory).glob("rank-*.json"):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):  # replaced between listing and reading
            continue
        beats[int(beat["rank"])] = beat
    return beats


def mark_preempted(progress_dir: Path, *, rank: int, step: int) -> None:
    """Rank 0, once the checkpoint of ``step`` is saved: tells the launcher why the ranks are exiting."""
    path = Path(progress_dir) / PREEMPTION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, {"rank": rank, "step": step, "time": time.time()})


def read_preemption(progress_dir: Path) -> dict[str, Any] | None:
    """The preemption marker ({"rank", "step", "time"}) of the attempt whose heartbeats are in
    ``progress_dir``, or None when its ranks wrote none."""
    try:
        return json.loads((Path(progress_dir) / PREEMPTION_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_atomically(path: Path, payload: dict[str, Any]) -> None:
    # The temporary name starts with a dot: readers that glob rank-*.json never pick it up.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)
