"""Rank 0's metrics, and the supervisor's per-rank ones, sent to the job's MLflow run by the task that supervises the job.

Ranks never import MLflow: rank 0 appends its metrics to the job folder's ``metrics.jsonl``
(``pipeline.job_files.MetricsSink``), one JSON line per call, and the task relays the file to the run. Importing
MLflow and opening its store took rank 0 about 2 s before its first step, and every rank waits for rank 0 at the
first all-reduce; the task process has MLflow imported already. The job folder is the channel every place
already shares with the task (heartbeats, errors, the result), so nothing here depends on where the ranks run,
and ranks need no route to the tracking server.

The supervisor's per-rank metrics (``telemetry.jsonl``, ``pipeline.job.telemetry``) are written the same way and go
the same way (``JobFiles.relayed``). What has been sent is a byte offset kept beside each file (``metrics.sent``),
so the relay is stateless: the task relays while the job runs and drains when it ends, the triggerer relays for a deferred task, and
``register_model`` sends whatever is left (after an outage longer than ``train.metrics_flush_timeout_s``).
A failed send keeps its lines and is retried with backoff; lines are marked sent only once MLflow took them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)

MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call
READ_BYTES = 4 << 20  # at most this much of the file per batch read
INTERVAL_S = 2.0
FAILED_FLUSH_S = 10.0  # after a job that failed: its retry should not wait long for a tracking server that is away

Send = Callable[[list[tuple[str, float, int, int]]], None]


class MetricsFile:
    """A job's ``metrics.jsonl`` and its sent mark beside it (``metrics.sent``: how many bytes MLflow has taken)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.mark = self.path.with_suffix(".sent")

    def sent_offset(self) -> int:
        try:
            offset = int(self.mark.read_text() or 0)
        except (OSError, ValueError):
            return 0
        size = self.path.stat().st_size if self.path.exists() else 0
        return offset if offset <= size else 0  # a file replaced by a shorter one starts over

    def pending(self) -> tuple[list[tuple[str, float, int, int]], int]:
        """Metric values past the sent mark (whole lines only: rank 0 may be writing the last one), at most
        about ``MAX_BATCH``, and the offset to mark once they are sent."""
        start = self.sent_offset()
        if not self.path.exists():
            return [], start
        with open(self.path, "rb") as fh:
            fh.seek(start)
            chunk = fh.read(READ_BYTES)
        values, end = [], start
        for line in chunk.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            end += len(line)
            values += _values(line, self.path)
            if len(values) >= MAX_BATCH:
                break
        return values, end

    def mark_sent(self, offset: int) -> None:
        from pipeline.diskspace import write_atomically

        write_atomically(self.mark, str(offset).encode())

    def unsent(self) -> int:
        """How many metric values are past the sent mark."""
        if not self.path.exists():
            return 0
        with open(self.path, "rb") as fh:
            fh.seek(self.sent_offset())
            return sum(len(_values(line, self.path)) for line in fh if line.endswith(b"\n"))

    def send(self, send: Send) -> int:
        """Send everything past the sent mark, a batch at a time; returns how many values were sent. A failure
        raises with the failed batch still unsent."""
        sent = 0
        while True:
            values, end = self.pending()
            if end == self.sent_offset():
                return sent
            for start in range(0, len(values), MAX_BATCH):  # one line of more than MAX_BATCH values
                send(values[start : start + MAX_BATCH])
            self.mark_sent(end)
            sent += len(values)


def _values(line: bytes, path: Path) -> list[tuple[str, float, int, int]]:
    try:
        row = json.loads(line)
        return [(key, float(value), int(row["timestamp"]), int(row["step"])) for key, value in row["metrics"].items()]
    except (ValueError, KeyError, TypeError, AttributeError):
        # A line cut short by a killed rank (the next attempt starts a new line after it): nothing to send.
        log.warning("skipping a malformed line in %s: %r", path, line[:200])
        return []


def mlflow_sender(run_id: str, tracking_uri: str | None = None) -> Send:
    """Sends to the run on ``tracking_uri`` (default: the configured one); MLflow is imported by the first send."""
    clients = []

    def send(batch: list[tuple[str, float, int, int]]) -> None:
        from mlflow.entities import Metric

        from pipeline.registry.tracking import client

        clients[:] = clients or [client(tracking_uri)]
        clients[0].log_batch(run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in batch])

    return send


def job_metrics(path: Path) -> list[MetricsFile]:
    """Every metrics file of the job whose rank 0 writes ``path`` (``JobFiles.metrics``): its ``JobFiles.relayed``."""
    from pipeline.job_files import JobFiles

    return [MetricsFile(relayed) for relayed in JobFiles(Path(path).parent).relayed]


class Relay:
    """Sends a job's metrics files every ``interval_s`` from a thread while a job runs. A failed send is retried with
    backoff (the tracking server may be away); ``close`` keeps sending for up to ``timeout_s`` and returns how
    many values are still unsent (they stay in the file for ``register_model``)."""

    def __init__(self, files: list[MetricsFile], send: Send, *, interval_s: float = INTERVAL_S,
                 max_backoff_s: float = 10.0, emit: Callable[[str], None] = log.info):
        self.files, self._send, self._emit = files, send, emit
        self._interval_s, self._max_backoff_s = interval_s, max_backoff_s
        self._wake, self._closing, self._abandon = threading.Event(), threading.Event(), threading.Event()
        self._outage_since: float | None = None
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="metrics-relay", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float) -> int:
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout_s)
        self.abandon()
        self._thread.join(30.0)  # a send in flight finishes or times out (MLFLOW_HTTP_REQUEST_TIMEOUT)
        unsent = sum(metrics.unsent() for metrics in self.files)
        if unsent:
            self._emit(f"tracking server still unreachable: {unsent} metric values not yet sent; they stay in "
                       f"{', '.join(str(m.path) for m in self.files if m.unsent())} and register_model sends them")
        return unsent

    def abandon(self) -> None:
        """Stop without waiting: a send in flight finishes in the background; the rest stays unsent."""
        self._abandon.set()
        self._wake.set()

    def _run(self) -> None:
        first_backoff = min(0.5, self._max_backoff_s)  # max_backoff_s bounds every wait, the first one too
        backoff = first_backoff
        while not self._abandon.is_set():
            closing = self._closing.is_set()
            try:
                for metrics in self.files:
                    self.sent += metrics.send(self._send)
            except Exception as exc:  # the lines stay past the sent mark: the server may come back
                if self._outage_since is None:
                    self._outage_since = time.monotonic()
                    self._emit(f"metric logging failed ({type(exc).__name__}: {str(exc)[:200]}); "
                               f"keeping them and retrying")
                self._abandon.wait(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)
                continue
            backoff = first_backoff
            if self._outage_since is not None:
                self._emit(f"metric logging recovered after {time.monotonic() - self._outage_since:.0f}s")
                self._outage_since = None
            if closing:
                return  # everything written before the close was sent
            self._wake.wait(self._interval_s)
            self._wake.clear()


class Relayed:
    """What ``relaying`` yields: ``unsent`` once the block ended (None while it runs, or with no run)."""

    unsent: int | None = None

    def into(self, result: Any) -> Any:
        """Rank 0's result with ``unsent_metrics`` added, where there was a run to send them to."""
        if isinstance(result, dict) and self.unsent is not None:
            return {**result, "unsent_metrics": self.unsent}
        return result


@contextlib.contextmanager
def relaying(spec, flush_timeout_s: float, emit: Callable[[str], None] = log.info) -> Iterator[Relayed]:
    """While the block runs ``spec``'s job (a ``JobSpec``), send its metrics file to the MLflow run its ranks were
    given (``MLFLOW_RUN_ID``, on their ``MLFLOW_TRACKING_URI``); at the end, keep sending for up to
    ``flush_timeout_s``. A job without a run relays nothing; a script that logs its own metrics writes no file."""
    relayed = Relayed()
    run_id = spec.env.get("MLFLOW_RUN_ID")
    if not run_id:
        yield relayed
        return
    sender = mlflow_sender(run_id, spec.env.get("MLFLOW_TRACKING_URI") or None)
    relay = Relay([MetricsFile(path) for path in spec.files.relayed], sender, emit=emit)
    try:
        yield relayed
    except BaseException:
        relayed.unsent = relay.close(min(flush_timeout_s, FAILED_FLUSH_S))
        raise
    relayed.unsent = relay.close(flush_timeout_s)


def flushed(spec, flush_timeout_s: float, emit: Callable[[str], None] = log.info) -> Relayed:
    """``relaying`` around nothing: a job that has ended (a deferred task back on a worker) sends what is left."""
    with relaying(spec, flush_timeout_s, emit) as relayed:
        pass
    return relayed


def send_rest(path: Path, run_id: str) -> int:
    """Send what a job's relay left unsent in its metrics files (rank 0's at ``path``, and the rest of
    ``job_metrics``) (``register_model``; a deferred task back on a worker); raises if the tracking server does not
    take it."""
    send = mlflow_sender(run_id)
    return sum(metrics.send(send) for metrics in job_metrics(path) if metrics.path.exists())
