"""The Kubernetes place (``launch.kind = kubernetes``): each attempt is an indexed Job of torchrun pods and
a headless Service (``pipeline.job.kubernetes.manifest``), through the Kubernetes provider's connection
and the official client, under the supervisor's policy (``pipeline.job.supervisor``).

One attempt: create the Service and the Job; every pod must be running within
``launch.kubernetes.schedule_timeout_s`` (otherwise the attempt did not start, and says why:
unschedulable with the scheduler's message, an image pull failure, a crash); every pod's log streams
into the task log as it is written, prefixed with its node rank, all pods at once; a failed pod ends
the attempt. ``stop`` deletes the Job with foreground propagation (its pods first) and the Service
with it; ``pipeline.job.kubernetes.orphan_guard`` does the same when the task process is killed outright. The
job folder must be on a volume the pods mount at the same path: rank 0's result, the ranks' user
errors, heartbeats and torchrun's error files are read from there, as on every place.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from typing import Any, Callable

from pipeline.job import orphan_guard
from pipeline.job.kubernetes.manifest import CONTAINER, Manifests, build
from pipeline.job.kubernetes.state import is_started, node_of, verdict
from pipeline.job.places import Clusters
from pipeline.job.policy import Ended
from pipeline.job.mirror import JobStore
from pipeline.job.spec import Attempt, JobSpec, without_secrets

log = logging.getLogger(__name__)

POLL_S = 1.0
GONE_TIMEOUT_S = 120.0
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def manifests_for(attempt: Attempt) -> Manifests:
    """The Job and Service of one attempt (``pipeline.job.spec.Attempt``): the ranks' environment
    every place gives them, less what looks like a secret (``without_secrets``: the Secrets of
    ``launch.kubernetes.env_from_secrets`` give those); names unique per DAG run, task, try and restart."""
    spec = attempt.spec
    env, left_out = without_secrets(attempt.env())
    if left_out:
        log.warning("left out of the pods' environment, stored in the Job's manifest: %s; the pods read secrets from "
                    "the Kubernetes Secrets of launch.kubernetes.env_from_secrets", ", ".join(left_out))
    store = JobStore.for_job(spec.job_dir, spec.launch.kind)
    return build(name=attempt.id, entry=list(spec.entry), launch=spec.launch, env=env, store=store and store.uri,
                 labels={**spec.labels, "restart": str(attempt.restart)}, log_dir=str(attempt.log_dir),
                 job_dir=str(spec.files.root), no_python=spec.no_python)


class Cluster:
    """The few API calls the Kubernetes place makes (the Role in the README grants exactly these)."""

    def __init__(self, client):
        from kubernetes import client as k8s

        self.client = client
        self.batch = k8s.BatchV1Api(client)
        self.core = k8s.CoreV1Api(client)

    def create(self, m: Manifests) -> None:  # services: create; jobs: create
        from kubernetes.client.exceptions import ApiException

        for create, body in ((self.core.create_namespaced_service, m.service), (self.batch.create_namespaced_job, m.job)):
            try:
                create(m.namespace, body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                # Left by a worker that died before its guard could act: same name, so same attempt.
                self.delete(m)
                self.wait_gone(m)
                create(m.namespace, body)

    def job(self, m: Manifests):  # jobs: get
        return self.batch.read_namespaced_job(m.name, m.namespace)

    def pods(self, m: Manifests) -> list:  # pods: list
        return self.core.list_namespaced_pod(m.namespace, label_selector=m.selector).items

    def delete(self, m: Manifests, grace_period_s: int = 10) -> None:  # jobs: delete; services: delete
        from kubernetes import client as k8s
        from kubernetes.client.exceptions import ApiException

        options = k8s.V1DeleteOptions(propagation_policy="Foreground", grace_period_seconds=grace_period_s)
        for delete in (self.batch.delete_namespaced_job, self.core.delete_namespaced_service):
            try:
                delete(m.name, m.namespace, body=options)
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def wait_gone(self, m: Manifests, timeout_s: float = GONE_TIMEOUT_S) -> bool:
        """Wait until the Job (foreground: after its pods) and every pod are gone."""
        from kubernetes.client.exceptions import ApiException

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.job(m)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                if not self.pods(m):
                    return True
            time.sleep(POLL_S / 2)
        return False

    def stream_log(self, m: Manifests, pod: str, node: int, emit: Callable[[str], None]) -> None:
        """Follow one pod's log to its end, each line prefixed with the node rank."""  # pods/log: get
        response = self.core.read_namespaced_pod_log(pod, m.namespace, container=CONTAINER, follow=True,
                                                     _preload_content=False)
        pending = b""
        try:
            for chunk in response.stream(4096):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    emit(f"[node {node}] {line.decode(errors='replace')}")
        finally:
            if pending:
                emit(f"[node {node}] {pending.decode(errors='replace')}")
            response.release_conn()


class LogStreams:
    """One thread per pod, each following its log from the moment its container runs."""

    def __init__(self, cluster: Cluster, manifests: Manifests, emit: Callable[[str], None]):
        self.cluster, self.manifests, self.emit = cluster, manifests, emit
        self.threads: dict[str, threading.Thread] = {}
        self.lock = threading.Lock()  # one line at a time in the task log

    def follow(self, pods: list) -> None:
        for pod in pods:
            name = pod.metadata.name
            if name not in self.threads and is_started(pod):
                thread = threading.Thread(target=self._run, args=(name, node_of(pod)), daemon=True,
                                          name=f"log-{name}")
                self.threads[name] = thread
                thread.start()

    def _run(self, pod: str, node: int) -> None:
        def emit(line: str) -> None:
            with self.lock:
                self.emit(line)

        try:
            self.cluster.stream_log(self.manifests, pod, node, emit)
        except Exception as exc:  # a pod deleted after it ended (autoscaler, teardown) has no log left: not a failure
            emit(f"[node {node}] (log stream of {pod} ended: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")

    def join(self, timeout_s: float, pods: list[str] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        for name, thread in self.threads.items():
            if pods is None or name in pods:
                thread.join(max(0.0, deadline - time.monotonic()))


class KubernetesPlace:
    """``launch.kind = kubernetes`` (see the module's description). ``submit``, ``handle`` and ``teardown``
    are what the deferred form (``pipeline.airflow.deferred``) uses: it creates the objects on a worker,
    waits in the triggerer (``pipeline.job.kubernetes.watch``) and tears them down by name."""

    watch = "pipeline.job.kubernetes.watch:PodsWatch"
    poll_s = POLL_S
    clock = staticmethod(time.monotonic)  # of the schedule timeout: a test moves it past the timeout at will

    def __init__(self, spec: JobSpec, clusters: Clusters):
        manifests_for(Attempt(spec, 0))  # a bad launch.kubernetes.* value fails here, before anything is created
        self.spec = spec
        self._clusters = clusters
        self._cluster: Cluster | None = None
        self._current: Manifests | None = None
        self._guard: subprocess.Popen | None = None
        self._logs: LogStreams | None = None
        self._lock = threading.Lock()  # stop() may come from another thread while an attempt starts

    @property
    def cluster(self) -> Cluster:
        if self._cluster is None:
            self._cluster = Cluster(self._clusters.kubernetes_client(self.spec.launch.kubernetes.connection_id))
        return self._cluster

    def submit(self, attempt: Attempt, emit: Callable[[str], None]) -> Manifests:
        """Create the attempt's Service and Job (replacing what a dead worker of the same attempt left)."""
        m, kube = manifests_for(attempt), self.spec.launch.kubernetes
        emit(f"creating Job {m.namespace}/{m.name}: {self.spec.launch.nnodes} pod(s) x "
             f"{self.spec.launch.nproc_per_node} rank(s), image {kube.image}"
             + (f", Kueue queue {kube.queue_name}" if kube.queue_name else ""))
        try:
            self.cluster.create(m)
        except BaseException:
            self.cluster.delete(m, int(self.spec.launch.grace_period_s))  # the Service may exist without its Job
            raise
        return m

    def handle(self, attempt: Attempt) -> dict[str, Any]:
        """What the triggerer needs to watch the attempt (JSON)."""
        m = manifests_for(attempt)
        return {"connection_id": self.spec.launch.kubernetes.connection_id, "namespace": m.namespace, "name": m.name,
                "nnodes": self.spec.launch.nnodes, "schedule_timeout_s": self.spec.launch.kubernetes.schedule_timeout_s}

    def teardown(self, attempt: Attempt, grace_period_s: float) -> None:
        """Delete the attempt's Job (its pods first) and Service by name, and wait until they are gone."""
        self._teardown(manifests_for(attempt), grace_period_s)

    def start(self, attempt: Attempt, emit: Callable[[str], None]) -> None:
        with self._lock:
            m = manifests_for(attempt)
            self._current = m
            self._guard = start_guard(self.cluster, m)
            self._logs = LogStreams(self.cluster, m, emit)
        self._emit = emit
        self._running = False
        self._last_detail: str | None = None
        self._started = self.clock()
        self.submit(attempt, emit)

    def poll(self) -> Ended | None:
        m, logs, nnodes = self._current, self._logs, self.spec.launch.nnodes
        if m is None or logs is None:
            return Ended("stopped")
        pods = self.cluster.pods(m)
        logs.follow(pods)
        now = verdict(self.cluster.job(m), pods, name=m.name, nnodes=nnodes, running=self._running,
                      waited_s=self.clock() - self._started,
                      schedule_timeout_s=self.spec.launch.kubernetes.schedule_timeout_s)
        if now.running and not self._running:
            self._emit(f"all {nnodes} pod(s) of {m.name} are running")
        elif not now.running and now.detail != self._last_detail:
            self._emit(f"waiting for pods: {now.detail}")
            self._last_detail = now.detail
        self._running = now.running
        if now.end is not None and now.end.status == "failed":
            logs.join(timeout_s=10, pods=list(now.failed_pods))  # the failed pods' last lines first
        elif now.end is not None and now.end.status == "succeeded":
            logs.join(timeout_s=30)  # the last lines before the result
            self._emit(now.end.message)
        return now.end

    def stop(self, grace_period_s: float) -> None:
        with self._lock:
            m, self._current = self._current, None
            guard_proc, self._guard = self._guard, None
            if m is None:
                return
            self._teardown(m, grace_period_s)
        if self._logs is not None:
            self._logs.join(timeout_s=10)
        orphan_guard.stop_guard(guard_proc)

    def dump_stacks(self, beats: dict, emit: Callable[[str], None]) -> None:
        """The ranks run in pods this process cannot signal: their last lines are in the log already."""

    def _teardown(self, m: Manifests, grace_period_s: float) -> None:
        self.cluster.delete(m, int(grace_period_s))
        if not self.cluster.wait_gone(m, timeout_s=grace_period_s + GONE_TIMEOUT_S):
            log.warning("Job %s/%s still present %ss after its foreground deletion", m.namespace, m.name,
                        grace_period_s + GONE_TIMEOUT_S)


def client_settings(client) -> dict[str, Any]:
    """What another process needs to reach the same API server (files inlined: the kube config
    loader's temporary copies go with this process)."""
    conf = client.configuration

    def content(path):
        if path and os.path.exists(path):
            with open(path) as fh:
                return fh.read()
        return None

    return {"host": conf.host, "api_key": dict(conf.api_key), "api_key_prefix": dict(conf.api_key_prefix),
            "verify_ssl": conf.verify_ssl, "ssl_ca_cert": content(conf.ssl_ca_cert), "cert_file": content(conf.cert_file),
            "key_file": content(conf.key_file),
            # In a pod the service account's token rotates: the guard reads the file when it acts.
            "token_file": SERVICE_ACCOUNT_TOKEN if os.path.exists(SERVICE_ACCOUNT_TOKEN) else None}


def start_guard(cluster: Cluster, m: Manifests) -> subprocess.Popen:
    """``pipeline.job.kubernetes.orphan_guard`` deletes the Job and Service if this process dies without tearing
    them down (``pipeline.job.orphan_guard``)."""
    request = {"client": client_settings(cluster.client), "namespace": m.namespace, "name": m.name}
    return orphan_guard.start_guard("pipeline.job.kubernetes.orphan_guard", request)
