"""Watching a training Job's pods from Airflow's triggerer (``launch.kubernetes.deferrable``).

``PodsWatch`` is the Kubernetes place's ``poll`` with the asyncio client, for ``AttemptTrigger``
(``pipeline.airflow.trigger``): the same verdict on the pods (``pipeline.job.kubernetes.state.verdict``), and
every pod's log in the task log as it is written, prefixed with its node rank. ``stop`` deletes the Job
(foreground: its pods first) and the Service as the place does (``Cluster.delete``, in a thread): the triggerer
calls it when a user marks the deferred task failed or success, or clears it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pipeline.job.kubernetes.manifest import CONTAINER, JOB_LABEL
from pipeline.job.kubernetes.state import is_started, node_of, verdict
from pipeline.job.places import Clusters
from pipeline.job.policy import Ended


class PodsWatch:
    clock = staticmethod(time.time)  # of the schedule timeout, against ``created_at``: a test moves it at will

    def __init__(self, *, connection_id: str, namespace: str, name: str, nnodes: int, schedule_timeout_s: float,
                 clusters: Clusters, created_at: float, log: logging.Logger):
        self.connection_id, self.namespace, self.name, self.clusters = connection_id, namespace, name, clusters
        self.nnodes, self.schedule_timeout_s, self.created_at, self.log = nnodes, schedule_timeout_s, created_at, log
        self.streams: dict[str, asyncio.Task] = {}
        self.running = False
        self.last: str | None = None
        self._api = None

    async def __aenter__(self) -> "PodsWatch":
        self._conn = self.clusters.kubernetes_async(self.connection_id)
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
        now = verdict(job, pods, name=self.name, nnodes=self.nnodes, running=self.running,
                      waited_s=self.clock() - self.created_at, schedule_timeout_s=self.schedule_timeout_s)
        if now.running and not self.running:
            self.log.info("all %d pod(s) of %s are running", self.nnodes, self.name)
        elif not now.running and now.detail != self.last:
            self.log.info("waiting for pods: %s", now.detail)
            self.last = now.detail
        self.running = now.running
        if now.end is not None and now.end.status == "failed":
            ended_streams = [self.streams[pod] for pod in now.failed_pods if pod in self.streams]
            if ended_streams:
                await asyncio.wait(ended_streams, timeout=10)  # the failed pods' last lines first
        elif now.end is not None and now.end.status == "succeeded" and self.streams:
            await asyncio.wait(list(self.streams.values()), timeout=30)  # the last lines before the event
        return now.end

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
        from pipeline.job.kubernetes.manifest import Manifests
        from pipeline.job.kubernetes.place import Cluster

        self.log.info("deleting Job %s/%s, its pods and its Service", self.namespace, self.name)
        client = await asyncio.to_thread(self.clusters.kubernetes_client, self.connection_id)
        await asyncio.to_thread(Cluster(client).delete, Manifests.named(self.namespace, self.name))
