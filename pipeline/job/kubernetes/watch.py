"""Watching a training Job's pods from Airflow's triggerer (``launch.kubernetes.deferrable``).

``PodsWatch`` is the Kubernetes place's ``poll`` with the asyncio client, for ``AttemptTrigger``
(``pipeline.airflow.trigger``): every pod must run within the schedule timeout (the same reasons when
one does not), every pod's log goes to the task log as it is written, prefixed with its node rank,
and the first failed pod or the Job's end is the attempt's end. ``stop`` deletes the Job (foreground:
its pods first) and the Service: the triggerer calls it when a user marks the deferred task failed or
success, or clears it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pipeline.job.kubernetes.state import failed_nodes, failed_what, is_started, job_condition, node_of, schedule_state
from pipeline.job.kubernetes.manifest import CONTAINER, JOB_LABEL
from pipeline.job.supervisor import Ended


class PodsWatch:
    def __init__(self, *, connection_id: str, namespace: str, name: str, nnodes: int, schedule_timeout_s: float,
                 created_at: float, log: logging.Logger):
        self.connection_id, self.namespace, self.name = connection_id, namespace, name
        self.nnodes, self.schedule_timeout_s, self.created_at, self.log = nnodes, schedule_timeout_s, created_at, log
        self.streams: dict[str, asyncio.Task] = {}
        self.running = False
        self.last: str | None = None
        self._api = None

    def _connection(self):
        from pipeline.airflow.connections import kubernetes_async_connection

        return kubernetes_async_connection(self.connection_id)

    async def __aenter__(self) -> "PodsWatch":
        self._conn = self._connection()
        self._api = await self._conn.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for task in self.streams.values():
            task.cancel()
        await self._conn.__aexit__(*exc)

    async def poll(self) -> Ended | None:
        from kubernetes_asyncio import client as k8s

        batch, core = k8s.BatchV1Api(self._api), k8s.CoreV1Api(self._api)
        job = await batch.read_namespaced_job(self.name, self.namespace)
        pods = (await core.list_namespaced_pod(self.namespace, label_selector=f"{JOB_LABEL}={self.name}")).items
        for pod in pods:
            if pod.metadata.name not in self.streams and is_started(pod):
                self.streams[pod.metadata.name] = asyncio.create_task(
                    self._stream(core, pod.metadata.name, node_of(pod)))
        ended = job_condition(job)
        if not self.running:
            state, detail, hopeless = schedule_state(job, pods, self.nnodes)
            if state == "ready" or (ended and ended[0] == "Complete"):
                self.running = True
                self.log.info("all %d pod(s) of %s are running", self.nnodes, self.name)
            else:
                if detail != self.last:
                    self.log.info("waiting for pods: %s", detail)
                    self.last = detail
                if hopeless or (ended and ended[0] == "Failed"):
                    return Ended("not_started", f"Job {self.name} could not start: {detail or ended[1]}")
                if time.time() - self.created_at > self.schedule_timeout_s:
                    return Ended("not_started", f"the pods of Job {self.name} were not all running within "
                                                f"launch.kubernetes.schedule_timeout_s={self.schedule_timeout_s:g}s: {detail}")
                return None
        failed = failed_nodes(pods)
        if failed or (ended and ended[0] == "Failed"):
            ended_streams = [self.streams[pod] for pod, _ in failed.values() if pod in self.streams]
            if ended_streams:
                await asyncio.wait(ended_streams, timeout=10)  # the failed pods' last lines first
            return Ended("failed", f"Job {self.name}: {failed_what(failed, ended)}")
        if ended and ended[0] == "Complete":
            if self.streams:
                await asyncio.wait(list(self.streams.values()), timeout=30)  # the last lines before the event
            return Ended("succeeded", f"Job {self.name} completed")
        return None

    async def _stream(self, core, pod: str, node: int) -> None:
        try:
            response = await core.read_namespaced_pod_log(pod, self.namespace, container=CONTAINER, follow=True,
                                                          _preload_content=False)
            async with response:
                async for raw in response.content:
                    self.log.info("[node %d] %s", node, raw.decode(errors="replace").rstrip("\n"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a pod deleted after it ended has no log left: not a failure
            self.log.info("[node %d] (log stream of %s ended: %s)", node, pod, type(exc).__name__)

    async def stop(self) -> None:
        from kubernetes_asyncio import client as k8s
        from kubernetes_asyncio.client.exceptions import ApiException

        self.log.info("deleting Job %s/%s, its pods and its Service", self.namespace, self.name)
        options = k8s.V1DeleteOptions(propagation_policy="Foreground")
        async with self._connection() as api:
            for delete in (k8s.BatchV1Api(api).delete_namespaced_job, k8s.CoreV1Api(api).delete_namespaced_service):
                try:
                    await delete(self.name, self.namespace, body=options)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
