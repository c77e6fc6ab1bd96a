"""Metric logging that never blocks training and loses nothing while the tracking server is away.

Metrics are stamped when logged, queued, and sent in batches by a background thread. A failed
send keeps the batch and retries with backoff; ``close`` waits for the queue to drain, and what
still cannot be sent is written to a spill file that the launching task replays.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call


class BufferedMetricLogger:
    def __init__(self, send: Callable[[list[tuple[str, float, int, int]]], None], *,
                 interval_s: float = 2.0, max_backoff_s: float = 10.0, emit: Callable[[str], None] = print):
        self._send = send
        self._interval_s = interval_s
        self._max_backoff_s = max_backoff_s
        self._emit = emit
        self._pending: list[tuple[str, float, int, int]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._abandon = threading.Event()
        self._outage_since: float | None = None
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="metric-logger", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        with self._lock:
            self._pending.extend((key, float(value), now_ms, step) for key, value in metrics.items())

    def close(self, timeout_s: float, spill_path: Path | None = None) -> int:
        """Drain the queue for up to ``timeout_s``; spill what is left. Returns how many were spilled."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._abandon.set()
        self._thread.join(5.0)
        with self._lock:
            left, self._pending = self._pending, []
        if left and spill_path is not None:
            spill_path.parent.mkdir(parents=True, exist_ok=True)
            with open(spill_path, "a") as fh:
                for key, value, timestamp, step in left:
                    fh.write(json.dumps({"key": key, "value": value, "timestamp": timestamp, "step": step}) + "\n")
            self._emit(f"tracking server still unreachable: {len(left)} metric values kept in {spill_path}")
        return len(left)

    def _run(self) -> None:
        backoff = 0.5
        while not self._abandon.is_set():
            self._wake.wait(self._interval_s)
            self._wake.clear()
            while not self._abandon.is_set():
                with self._lock:
                    batch = self._pending[:MAX_BATCH]
                if not batch:
                    break
                try:
                    self._send(batch)
                except Exception as exc:  # keep the batch: the server may come back
                    if self._outage_since is None:
                        self._outage_since = time.monotonic()
                        self._emit(f"metric logging failed ({type(exc).__name__}); buffering and retrying")
                    self._abandon.wait(backoff)
                    backoff = min(backoff * 2, self._max_backoff_s)
                    continue
                with self._lock:
                    del self._pending[: len(batch)]
                self.sent += len(batch)
                backoff = 0.5
                if self._outage_since is not None:
                    self._emit(f"metric logging recovered after {time.monotonic() - self._outage_since:.0f}s")
                    self._outage_since = None
            if self._closing:
                return


def mlflow_sender(mlflow_client, run_id: str) -> Callable[[list[tuple[str, float, int, int]]], None]:
    from mlflow.entities import Metric

    def send(batch: list[tuple[str, float, int, int]]) -> None:
        mlflow_client.log_batch(run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in batch])

    return send


def replay_spill(spill_path: Path, send: Callable[[list[Any]], None]) -> int:
    """Send the metrics a training job could not deliver; remove the file once all are sent."""
    if not spill_path.exists():
        return 0
    rows = [json.loads(line) for line in spill_path.read_text().splitlines() if line.strip()]
    batch = [(r["key"], r["value"], r["timestamp"], r["step"]) for r in rows]
    for start in range(0, len(batch), MAX_BATCH):
        send(batch[start : start + MAX_BATCH])
    spill_path.unlink()
    return len(batch)
