"""The job folder: what the supervisor and the ranks of one training job share, and the only place its layout,
its environment variables and its files' formats are written.

The supervisor exports the folder's paths to every rank (``JobFiles.env``: ``PIPELINE_JOB_DIR``,
``PIPELINE_CHECKPOINT_DIR``, ``PIPELINE_RESULT_FILE``, ``PIPELINE_PROGRESS_DIR``, ``PIPELINE_ERROR_DIR``); the
ranks write, and the supervisor reads:

- heartbeats: each rank's ``progress/rank-R.json`` (pid, host, step, total, epoch, phase, time), at most every
  ``interval_s`` and at once on an epoch or checkpoint boundary, replaced atomically; any training script can
  call ``Heartbeat.from_env().beat(step)`` after each optimizer step. ``DUMP_SIGNAL`` makes a rank print its stacks.
  A rank's own figures of its last window of steps (``Heartbeat.report``: step time, samples/s, data-wait share,
  compute time) ride in the same file as ``windows`` (the last ``WINDOWS_KEPT``), and in each node's local rank
  0's file its node's utilisation every ``NODE_SAMPLE_S`` as ``node`` (``pipeline.node_usage``); the supervisor
  turns them into per-rank metrics and names stragglers (``pipeline.job.telemetry``), with no collective between
  ranks;
- the preemption marker: when the ranks stop on SIGTERM (an eviction, a spot reclaim), rank 0 writes
  ``progress/preempted.json`` once the checkpoint of the step they agreed on is saved, and every rank exits
  with ``PREEMPTED_EXIT_CODE``: the attempt is restarted and resumes at that step;
- user errors: a rank that raises a ``UserError`` writes ``errors/rank-R.json`` (``user_errors_reported``)
  before it dies, and the supervisor raises it as a ``RankUserError`` (``reported_user_error``), so neither a
  restart nor a retry follows;
- rank 0's result (``result.json``, the task's XCom) and metrics (``metrics.jsonl``, relayed to MLflow; both
  metrics files are written by ``MetricsSink``), and the supervisor's per-rank metrics (``telemetry.jsonl``, relayed the same way) and its record of every attempt's
  hours and cost (``attempts.jsonl``).

Every write to the folder goes through the disk-space rule (``pipeline.diskspace``): a full disk is one
``OutOfSpace`` naming the file, the bytes it needed and the bytes free, a user error that is not retried.

Standard library only: the supervisor, every rank and a toolchain's own interpreter import it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.diskspace import space_checked
from pipeline.errors import RankUserError, UserError

JOB_DIR_ENV = "PIPELINE_JOB_DIR"
CHECKPOINT_DIR_ENV = "PIPELINE_CHECKPOINT_DIR"
RESULT_FILE_ENV = "PIPELINE_RESULT_FILE"
PROGRESS_DIR_ENV = "PIPELINE_PROGRESS_DIR"
ERROR_DIR_ENV = "PIPELINE_ERROR_DIR"
JOB_STORE_ENV = "PIPELINE_JOB_STORE_URI"  # the job folder's copy on an object store, when nodes share none
DUMP_SIGNAL = signal.SIGUSR1  # the supervisor sends it to every rank before stopping a stalled job
# EX_TEMPFAIL from sysexits.h: "try again later", which is what a preempted attempt asks for.
PREEMPTED_EXIT_CODE = 75
PREEMPTION_FILE = "preempted.json"
_HOST = socket.gethostname()
WINDOWS_KEPT = 8  # a rank's last reports of its figures kept in its heartbeat file
NODE_SAMPLE_S = 5.0  # seconds between the samples of a node's utilisation (its local rank 0's heartbeat)


@dataclass(frozen=True)
class JobFiles:
    """The layout of a job's folder; each path is exported to the ranks as an environment variable."""

    root: Path

    @classmethod
    def from_env(cls) -> "JobFiles | None":
        """In a rank: the job folder the supervisor exported (``PIPELINE_JOB_DIR``), if any."""
        root = os.environ.get(JOB_DIR_ENV)
        return cls(Path(root)) if root else None

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def result(self) -> Path:  # rank 0's JSON result: the task's XCom
        return self.root / "result.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:  # rank 0's metrics, one JSON line per call; the task sends them to MLflow
        return self.root / "metrics.jsonl"

    @property
    def telemetry(self) -> Path:  # the supervisor's per-rank metrics, the same format; relayed to MLflow too
        return self.root / "telemetry.jsonl"

    @property
    def tracking(self) -> Path:  # the job's MLflow run ({"run_id", "experiment_id", "url"}), for the job view
        return self.root / "mlflow.json"

    @property
    def attempts(self) -> Path:  # one line per attempt that ended: its hours and cost (pipeline.job.cost)
        return self.root / "attempts.jsonl"

    @property
    def relayed(self) -> tuple[Path, Path]:  # every file of metrics the task sends to the job's MLflow run
        return self.metrics, self.telemetry

    @property
    def progress(self) -> Path:  # per-rank heartbeats, read by the stall watchdog
        return self.root / "progress"

    @property
    def errors(self) -> Path:  # user errors reported by ranks (user_errors_reported)
        return self.root / "errors"

    def logs(self, try_number: int) -> Path:
        return self.root / f"logs-try{try_number}"

    def env(self) -> dict[str, str]:
        return {JOB_DIR_ENV: str(self.root), CHECKPOINT_DIR_ENV: str(self.checkpoints),
                RESULT_FILE_ENV: str(self.result), PROGRESS_DIR_ENV: str(self.progress), ERROR_DIR_ENV: str(self.errors)}

    def expand(self, text: str) -> str:
        """``text`` with ``${PIPELINE_JOB_DIR}``, ``${PIPELINE_CHECKPOINT_DIR}`` (the variables of ``env``) replaced by
        their paths: a CLI's arguments name the job's folders without a shell."""
        paths = self.env()
        return re.sub(r"\$\{(PIPELINE_[A-Z_]+)\}", lambda m: paths.get(m.group(1), m.group(0)), text)

    def read_result(self) -> dict[str, Any] | None:
        return json.loads(self.result.read_text()) if self.result.exists() else None

    def begin_attempt(self, restart: int) -> None:
        """The folder as attempt ``restart`` expects it: the previous attempt's heartbeats, user errors and
        preemption marker are not this one's; a previous try's result is never reported."""
        self.root.mkdir(parents=True, exist_ok=True)
        if restart == 0:
            self.result.unlink(missing_ok=True)
        for folder in (self.progress, self.errors):
            shutil.rmtree(folder, ignore_errors=True)
        self.progress.mkdir(parents=True)

    def clear_preemption(self) -> None:
        """A restart inside one attempt (Ray Train's): the marker was the last start's, not the next one's."""
        (self.progress / PREEMPTION_FILE).unlink(missing_ok=True)


class Heartbeat:
    """A rank's heartbeat file (see the module's description)."""

    def __init__(self, directory: Path | None, rank: int, *, interval_s: float = 1.0):
        self.path = Path(directory) / f"rank-{rank}.json" if directory else None
        self.rank = rank
        self.interval_s = interval_s
        self._last_write = 0.0
        self._windows: list[dict[str, Any]] = []  # the last WINDOWS_KEPT reports, oldest first
        self._node: tuple[int, Any] | None = None  # (node, its sampler) in the node's local rank 0
        self._node_sample: dict[str, Any] = {}
        if self.path:
            from pipeline.node_usage import NodeUsage, node_index

            node = node_index()
            self._node = (node, NodeUsage()) if node is not None else None
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
        beat = {"rank": self.rank, "pid": os.getpid(), "host": _HOST, "step": step, "total": total, "epoch": epoch,
                "phase": phase, "time": now}
        if self._node and now - self._node_sample.get("time", 0.0) >= NODE_SAMPLE_S:
            node, usage = self._node
            self._node_sample = {"node": node, "time": now} | usage.sample()
        _write_atomically(self.path, beat | ({"windows": self._windows} if self._windows else {})
                          | ({"node": self._node_sample} if self._node_sample else {}))

    def report(self, step: int, figures: dict[str, float], *, total: int | None = None,
               epoch: int | None = None) -> None:
        """This rank's figures over its window of steps ending at ``step`` (``Throughput.window``), written at
        once with the position; every rank reports at the same steps. The last ``WINDOWS_KEPT`` stay in the file,
        so a reader polling less often than windows end misses none."""
        self._windows = self._windows[1 - WINDOWS_KEPT:] + [
            {"step": step} | {key: float(value) for key, value in figures.items()}]
        self.beat(step, total=total, epoch=epoch, force=True)


class MetricsSink:
    """A metrics file of the job folder (rank 0's ``metrics.jsonl``, the supervisor's ``telemetry.jsonl``), appended
    one line per call, written whole; the task that supervises the job sends them to its MLflow run
    (``pipeline.registry.metrics_relay``). Ranks never import MLflow: it would cost seconds before the first step,
    and every rank waits for rank 0 there."""

    def __init__(self, path: Path | None):
        self._file = None
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")
            if self._file.tell() and _last_byte(path) != b"\n":
                self._write("\n")  # a line cut short by a killed attempt stays on its own

    def log(self, values: dict[str, float], step: int) -> None:
        if self._file is not None:
            row = {"step": step, "timestamp": int(time.time() * 1000),
                   "metrics": {key: float(value) for key, value in values.items()}}
            self._write(json.dumps(row) + "\n")

    def _write(self, line: str) -> None:
        with space_checked(self.path, len(line)):
            try:
                self._file.write(line)
                self._file.flush()
            except OSError:
                self._abandon()  # its buffer would be flushed again, and fail again, when it is collected
                raise

    def _abandon(self) -> None:
        file, self._file = self._file, None
        with contextlib.suppress(OSError):
            file.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1)


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
    """Rank 0, once the checkpoint of ``step`` is saved: tells the supervisor why the ranks are exiting."""
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
    text = json.dumps(payload)
    with space_checked(path, len(text)):
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


@contextlib.contextmanager
def user_errors_reported():
    """In a rank: record a ``UserError`` escaping the block where the supervisor looks, then re-raise it."""
    try:
        yield
    except UserError as exc:
        directory = os.environ.get(ERROR_DIR_ENV)
        if directory:
            rank = os.environ.get("RANK", "0")
            path = Path(directory) / f"rank-{rank}.json"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"rank": int(rank), "type": type(exc).__name__, "message": str(exc)}))
                os.replace(tmp, path)
            except OSError as report_failed:  # a disk with not even a few bytes free: the error itself still shows
                print(f"could not report the {type(exc).__name__} to the supervisor ({report_failed}); the attempt "
                      f"will look like an infrastructure failure", flush=True)
        raise


def reported_user_error(directory: Path) -> RankUserError | None:
    """The user error a rank reported in ``directory`` (the lowest rank's), if any."""
    found = []
    for path in Path(directory).glob("rank-*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if not found:
        return None
    first = min(found, key=lambda e: e["rank"])
    return RankUserError(f"rank {first['rank']}: {first['type']}: {first['message']}")
