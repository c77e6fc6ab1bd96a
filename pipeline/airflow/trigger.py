"""``AttemptTrigger``: the supervisor's wait for one attempt, in Airflow's triggerer (a deferred task).

It runs the place's async watch (``DeferrablePlace.watch``: a class path; its ``poll`` and ``stop``) and the same
``Watchdog`` as the worker (the run timeout; the stall clock where the triggerer can read the job
folder's heartbeats) and the same per-rank telemetry (``pipeline.job.telemetry``: stragglers named in the
triggerer's log), and fires one event with how the attempt ended. The task then resumes on a worker
(``pipeline.airflow.deferred.complete``), which tears the attempt down and applies the policy. When a
user marks the deferred task failed or success, or clears it, the triggerer calls ``on_kill``: the
attempt is stopped there. A triggerer restart does not call it: the trigger resumes elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from pipeline.job.mirror import JobStore
from pipeline.job.supervisor import Watchdog
from pipeline.job_files import JobFiles

POLL_S = 1.0


class AttemptTrigger(BaseTrigger):
    def __init__(self, *, watch: str, handle: dict[str, Any], timeout_s: float, stall_timeout_s: float,
                 progress_dir: str, created_at: float, poll_s: float = POLL_S, metrics: dict[str, str] | None = None,
                 telemetry: dict[str, Any] | None = None, store: str | None = None):
        super().__init__()
        self.watch, self.handle = watch, handle
        self.timeout_s, self.stall_timeout_s, self.progress_dir = timeout_s, stall_timeout_s, progress_dir
        self.created_at, self.poll_s = created_at, poll_s
        self.metrics = metrics  # rank 0's metrics file, its MLflow run and tracking URI: relayed while it waits
        self.telemetry = telemetry  # RankTelemetry's arguments: path, ratio, windows
        self.store = store  # the job folder's copy, where the nodes share no folder (pipeline.job.mirror)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "watch": self.watch, "handle": self.handle, "timeout_s": self.timeout_s,
            "stall_timeout_s": self.stall_timeout_s, "progress_dir": self.progress_dir,
            "created_at": self.created_at, "poll_s": self.poll_s, "metrics": self.metrics,
            "telemetry": self.telemetry, "store": self.store})

    def _watcher(self):
        from pipeline.airflow.connections import AirflowClusters
        from pipeline.job.places import watch_for

        return watch_for(self.watch, self.handle, clusters=AirflowClusters(), created_at=self.created_at, log=self.log)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        watchdog = Watchdog(timeout_s=self.timeout_s, stall_timeout_s=self.stall_timeout_s,
                            progress_dir=Path(self.progress_dir), started=self.created_at)
        relay = self._relay()
        try:
            async for event in self._wait(watchdog):
                yield event
        finally:
            if relay is not None:
                relay.abandon()  # the task, back on a worker, sends the rest

    async def _wait(self, watchdog: Watchdog) -> AsyncIterator[TriggerEvent]:
        from pipeline.job.telemetry import RankTelemetry

        ranks = RankTelemetry(**self.telemetry) if self.telemetry else None
        store = JobStore(self.store) if self.store else None
        files = JobFiles(Path(self.progress_dir).parent)
        async with self._watcher() as watcher:
            while True:
                end = await watcher.poll()
                if end is None:
                    if store is not None:
                        await asyncio.to_thread(store.pull, files)
                    end = await asyncio.to_thread(watchdog.check, time.time())  # reads files: off the event loop
                    for line in await asyncio.to_thread(ranks.update, watchdog.beats) if ranks else []:
                        self.log.info("%s", line)
                if end is not None:
                    if end.status in ("timeout", "stalled"):
                        self.log.info("%s", end.message)
                    yield TriggerEvent({"status": end.status, "message": end.message, "started_at": self.created_at})
                    return
                await asyncio.sleep(self.poll_s)

    def _relay(self):
        """Rank 0's metrics sent to MLflow from a thread of the triggerer while the job runs."""
        if not self.metrics:
            return None
        from pipeline.registry.metrics_relay import Relay, job_metrics, mlflow_sender

        sender = mlflow_sender(self.metrics["run_id"], self.metrics.get("tracking_uri") or None)
        return Relay(job_metrics(Path(self.metrics["path"])), sender, emit=self.log.info)

    async def on_kill(self) -> None:
        """The user marked the deferred task failed or success, or cleared it: stop the attempt here."""
        self.log.info("the task was stopped while deferred")
        await self._watcher().stop()
