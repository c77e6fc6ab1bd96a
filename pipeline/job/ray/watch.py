"""Watching a Ray job from Airflow's triggerer (``launch.ray.deferrable``).

``RayJobWatch`` is the Ray place's ``poll`` for ``AttemptTrigger`` (``pipeline.airflow.trigger``): the job's
status (the Jobs API's HTTP calls run in a thread, never on the triggerer's event loop), its log streamed
into the task log over the Jobs API's websocket as it is written, and the same endings as the place's.
``stop`` stops the job (``stop_job``) and waits until it has ended: the triggerer calls it when a user
marks the deferred task failed or success, or clears it. The token is looked up from the connection
here, never stored with the trigger.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pipeline.job.ray.place import STOP_TIMEOUT_S, JobLog, job_end, stop_job
from pipeline.job.places import Clusters
from pipeline.job.policy import Ended


class RayJobWatch:
    def __init__(self, *, address: str, connection_id: str, submission_id: str, start_timeout_s: float,
                 clusters: Clusters, created_at: float, log: logging.Logger):
        self.address, self.connection_id, self.submission_id = address, connection_id, submission_id
        self.clusters = clusters
        self.start_timeout_s, self.created_at, self.log = start_timeout_s, created_at, log
        self._client = None
        self._log: JobLog | None = None
        self._following: asyncio.Task | None = None

    async def _jobs_client(self):
        if self._client is None:
            from pipeline.job.ray.cluster import jobs_client

            _, token = await asyncio.to_thread(self.clusters.ray, self.connection_id)
            self._client = await asyncio.to_thread(jobs_client, self.address, token)
        return self._client

    async def __aenter__(self) -> "RayJobWatch":
        client = await self._jobs_client()
        self._log = JobLog(client, self.submission_id, lambda line: self.log.info("%s", line))
        self._following = asyncio.create_task(self._log.follow())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._following is not None:
            self._following.cancel()

    async def poll(self) -> Ended | None:
        client = await self._jobs_client()
        info = await asyncio.to_thread(client.get_job_info, self.submission_id)
        end = job_end(info, self.submission_id, pending_s=time.time() - self.created_at,
                      start_timeout_s=self.start_timeout_s)
        if end is not None and self._log is not None:
            await asyncio.to_thread(self._log.finish)  # the last lines before the event
        return end

    async def stop(self) -> None:
        client = await self._jobs_client()
        await asyncio.to_thread(stop_job, client, self.submission_id, STOP_TIMEOUT_S)
