"""Waiting for a training Job's pods in Airflow's triggerer (``launch.kubernetes.deferrable``).

``TorchrunPodsTrigger`` does what the launcher's wait does, with the asyncio client: every pod must
run within the schedule timeout (the same reasons when one does not), every pod's log goes to the
task log as it is written, prefixed with its node rank, and the first failed pod, the Job's end or
the run timeout fires the event. The task then resumes on a worker (``TorchrunOperator.execute_complete``),
which deletes the Job and reads rank 0's result. When a user marks the deferred task failed or
success, or clears it, the triggerer calls ``on_kill``: the Job (foreground: its pods first) and the
Service are deleted there. A triggerer restart does not call it: the trigger resumes elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from pipeline.launch import kube_state
from pipeline.launch.kube_manifest import CONTAINER, JOB_LABEL

POLL_S = 1.0


class TorchrunPodsTrigger(BaseTrigger):
    def __init__(self, *, connection_id: str, namespace: str, name: str, nnodes: int, schedule_timeout_s: float,
                 timeout_s: float, created_at: float, poll_s: float = POLL_S):
        super().__init__()
        self.connection_id, self.namespace, self.name = connection_id, namespace, name
        self.nnodes, self.schedule_timeout_s, self.timeout_s = nnodes, schedule_timeout_s, timeout_s
        self.created_at, self.poll_s = created_at, poll_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "connection_id": self.connection_id, "namespace": self.namespace, "name": self.name,
            "nnodes": self.nnodes, "schedule_timeout_s": self.schedule_timeout_s, "timeout_s": self.timeout_s,
            "created_at": self.created_at, "poll_s": self.poll_s})

    def _hook(self):
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

        return AsyncKubernetesHook(conn_id=self.connection_id)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from kubernetes_asyncio import client as k8s

        streams: dict[str, asyncio.Task] = {}
        try:
            async with self._hook().get_conn() as api:
                batch, core = k8s.BatchV1Api(api), k8s.CoreV1Api(api)
                event = await self._watch(batch, core, streams)
                if event["status"] == "complete":
                    await asyncio.wait(list(streams.values()), timeout=30)  # the last lines before the event
                yield TriggerEvent(event)
        finally:
            for task in streams.values():
                task.cancel()

    async def _watch(self, batch, core, streams: dict[str, asyncio.Task]) -> dict[str, Any]:
        running_since = None
        last = None
        while True:
            job = await batch.read_namespaced_job(self.name, self.namespace)
            pods = (await core.list_namespaced_pod(self.namespace, label_selector=f"{JOB_LABEL}={self.name}")).items
            for pod in pods:
                if pod.metadata.name not in streams and kube_state.is_started(pod):
                    streams[pod.metadata.name] = asyncio.create_task(
                        self._stream(core, pod.metadata.name, kube_state.node_of(pod)))
            ended = kube_state.job_condition(job)
            failed = {kube_state.node_of(p): (p.metadata.name, kube_state.failure(p)) for p in pods if kube_state.failure(p)}
            if running_since is None:
                state, detail, hopeless = kube_state.schedule_state(job, pods, self.nnodes)
                if state == "ready" or (ended and ended[0] == "Complete"):
                    running_since = time.time()
                    self.log.info("all %d pod(s) of %s are running", self.nnodes, self.name)
                else:
                    if detail != last:
                        self.log.info("waiting for pods: %s", detail)
                        last = detail
                    if hopeless or (ended and ended[0] == "Failed"):
                        return {"status": "not_running", "message": f"Job {self.name} could not start: {detail or ended[1]}"}
                    if time.time() - self.created_at > self.schedule_timeout_s:
                        return {"status": "not_running", "message": (
                            f"the pods of Job {self.name} were not all running within "
                            f"launch.kubernetes.schedule_timeout_s={self.schedule_timeout_s:g}s: {detail}")}
            if failed or (ended and ended[0] == "Failed"):
                if failed:
                    node, (pod, how) = min(failed.items())
                    message = f"Job {self.name}: node {node} (pod {pod}) {how}"
                else:
                    message = f"Job {self.name}: the Job failed ({ended[1]})"
                ended_streams = [streams[pod] for pod, _ in failed.values() if pod in streams]
                if ended_streams:
                    await asyncio.wait(ended_streams, timeout=10)  # the failed pods' last lines first
                return {"status": "failed", "message": message}
            if ended and ended[0] == "Complete":
                return {"status": "complete", "message": f"Job {self.name} completed"}
            if running_since is not None and time.time() - running_since > self.timeout_s:
                return {"status": "timeout", "message": f"training ran past launch.timeout_s={self.timeout_s:g}s and was stopped"}
            await asyncio.sleep(self.poll_s)

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

    async def on_kill(self) -> None:
        """The user marked the deferred task failed or success, or cleared it: delete the Job and Service."""
        from kubernetes_asyncio import client as k8s
        from kubernetes_asyncio.client.exceptions import ApiException

        self.log.info("the task was stopped while deferred: deleting Job %s/%s, its pods and its Service",
                      self.namespace, self.name)
        options = k8s.V1DeleteOptions(propagation_policy="Foreground")
        async with self._hook().get_conn() as api:
            for delete in (k8s.BatchV1Api(api).delete_namespaced_job, k8s.CoreV1Api(api).delete_namespaced_service):
                try:
                    await delete(self.name, self.namespace, body=options)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
