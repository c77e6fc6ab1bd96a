"""The Kubernetes launcher (``launch.kind = kubernetes``): the job as an indexed Job of torchrun pods and
a headless Service (``pipeline.launch.kube_manifest``), through the Kubernetes provider's connection
and the official client.

One attempt: create the Service and the Job; every pod must be running within
``launch.kubernetes.schedule_timeout_s`` (otherwise the attempt fails naming why: unschedulable with the
scheduler's message, an image pull failure, a crash); every pod's log streams into the task log as it
is written, prefixed with its node rank, all pods at once; a failed pod ends the attempt. Whatever
ends it (success, failure, timeout, stall, ``stop()``), the Job is deleted with foreground propagation
(its pods first) and the Service with it; ``pipeline.launch.kube_guard`` does the same when the task
process is killed outright. ``launch.max_restarts`` replaces the whole Job, which resumes from the
job folder's checkpoints. The job folder must be on a volume the pods mount at the same path: rank 0's
result, the ranks' user errors, heartbeats and torchrun's error files are read from there, so errors
are classified as in the local launcher.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from pipeline.errors import TrainingFailed, TrainingStalled, reported_user_error
from pipeline.launch import kube_state
from pipeline.launch.kube_manifest import CONTAINER, Manifests, build, object_name
from pipeline.launch.spec import JobSpec
from pipeline.train.progress import read_heartbeats

log = logging.getLogger(__name__)

POLL_S = 1.0
GONE_TIMEOUT_S = 120.0
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


class PodsNotRunning(TrainingFailed):
    """The pods were not all running within ``launch.kubernetes.schedule_timeout_s``."""


def api_client(connection_id: str):
    """The official client's ``ApiClient`` for the provider's connection (in-cluster or kube config without one)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    return KubernetesHook(conn_id=connection_id).get_conn()


def manifests_for(spec: JobSpec, restart: int) -> Manifests:
    """The Job and Service of one attempt of ``spec``: same entry, environment and job folder as the
    local launcher; names unique per DAG run, task, try and restart."""
    files = spec.files
    env = {**spec.env, **files.env(), "PIPELINE_TRY_NUMBER": str(spec.try_number),
           "PIPELINE_BACKEND": spec.launch.backend, "PIPELINE_RESTART_COUNT": str(restart)}
    return build(name=object_name(spec.name, spec.labels, restart), entry=list(spec.entry), launch=spec.launch,
                 env=env, labels={**spec.labels, "restart": str(restart)},
                 log_dir=str(files.logs(spec.try_number) / f"torchrun-{restart}"), job_dir=str(files.root),
                 no_python=spec.no_python)


class Cluster:
    """The few API calls the launcher makes (the Role in the README grants exactly these)."""

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
            if name not in self.threads and kube_state.is_started(pod):
                thread = threading.Thread(target=self._run, args=(name, kube_state.node_of(pod)), daemon=True,
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


class KubernetesLauncher:
    """``launch.kind = kubernetes`` (see the module's description)."""

    def __init__(self, client_factory: Callable[[str], Any] = api_client):
        self._client_factory = client_factory
        self._stopped = threading.Event()
        self._current: tuple[Cluster, Manifests] | None = None
        self._teardown_lock = threading.Lock()

    def run(self, spec: JobSpec, emit: Callable[[str], None]) -> None:
        manifests_for(spec, 0)  # a bad launch.kubernetes.* value fails here, before anything is created
        cluster = Cluster(self._client_factory(spec.launch.kubernetes.connection_id))
        for restart in range(spec.launch.max_restarts + 1):
            if self._stopped.is_set():
                raise TrainingFailed("the training job was stopped (the task was killed, cleared or timed out)")
            try:
                return self._attempt(cluster, spec, emit, restart)
            except (TrainingStalled, PodsNotRunning):
                raise  # the machines' or the cluster's: the task retry decides
            except TrainingFailed as exc:
                if restart == spec.launch.max_restarts or self._stopped.is_set():
                    raise
                emit(f"{str(exc).splitlines()[0]}; replacing the Job ({restart + 1} of {spec.launch.max_restarts}); "
                     f"training resumes from its last checkpoint")

    def stop(self) -> None:
        """Stop for good from any thread (``on_kill``, a signal): delete the Job, its pods and the Service now."""
        self._stopped.set()
        if self._current is not None:
            self._teardown(*self._current, grace_period_s=10)

    def _attempt(self, cluster: Cluster, spec: JobSpec, emit: Callable[[str], None], restart: int) -> None:
        import shutil

        files, kube = spec.files, spec.launch.kubernetes
        for folder in (files.progress, files.errors):
            shutil.rmtree(folder, ignore_errors=True)  # a previous attempt's heartbeats and errors are not this one's
        files.progress.mkdir(parents=True)
        m = manifests_for(spec, restart)
        emit(f"creating Job {m.namespace}/{m.name}: {spec.launch.nnodes} pod(s) x {spec.launch.nproc_per_node} "
             f"rank(s), image {kube.image}" + (f", Kueue queue {kube.queue_name}" if kube.queue_name else ""))
        guard = start_guard(cluster, m)
        self._current = (cluster, m)
        logs = LogStreams(cluster, m, emit)
        try:
            cluster.create(m)
            self._wait_running(cluster, m, spec, logs, emit)
            self._wait_done(cluster, m, spec, logs, emit)
        finally:
            self._teardown(cluster, m, grace_period_s=int(spec.launch.grace_period_s))
            logs.join(timeout_s=10)
            self._current = None
            stop_guard(guard)

    def _wait_running(self, cluster: Cluster, m: Manifests, spec: JobSpec, logs: LogStreams,
                      emit: Callable[[str], None]) -> None:
        kube = spec.launch.kubernetes
        deadline = time.monotonic() + kube.schedule_timeout_s
        last = None
        while True:
            self._check_stopped()
            job, pods = cluster.job(m), cluster.pods(m)
            logs.follow(pods)
            ended = kube_state.job_condition(job)
            state, detail, hopeless = kube_state.schedule_state(job, pods, spec.launch.nnodes)
            if state == "ready" or (ended and ended[0] == "Complete"):
                emit(f"all {spec.launch.nnodes} pod(s) of {m.name} are running")
                return
            if detail != last:
                emit(f"waiting for pods: {detail}")
                last = detail
            if hopeless or (ended and ended[0] == "Failed"):
                raise PodsNotRunning(f"Job {m.name} could not start: {detail or ended[1]}")
            if time.monotonic() > deadline:
                raise PodsNotRunning(f"the pods of Job {m.name} were not all running within "
                                     f"launch.kubernetes.schedule_timeout_s={kube.schedule_timeout_s:g}s: {detail}")
            time.sleep(POLL_S)

    def _wait_done(self, cluster: Cluster, m: Manifests, spec: JobSpec, logs: LogStreams,
                   emit: Callable[[str], None]) -> None:
        launch = spec.launch
        started = last_change = time.monotonic()
        last_beats: dict = {}
        while True:
            self._check_stopped()
            job, pods = cluster.job(m), cluster.pods(m)
            logs.follow(pods)
            failed = {kube_state.node_of(p): (p.metadata.name, kube_state.failure(p)) for p in pods if kube_state.failure(p)}
            ended = kube_state.job_condition(job)
            if failed or (ended and ended[0] == "Failed"):
                raise self._failure(spec, m, failed, ended, logs)
            if ended and ended[0] == "Complete":
                logs.join(timeout_s=30)  # the last lines before the result
                emit(f"Job {m.name} completed")
                return
            now = time.monotonic()
            if now - started > launch.timeout_s:
                raise TrainingFailed(f"training ran past launch.timeout_s={launch.timeout_s}s and was stopped")
            beats = read_heartbeats(spec.files.progress)
            progress = {rank: {k: v for k, v in beat.items() if k != "time"} for rank, beat in beats.items()}
            if progress != last_beats:
                last_beats, last_change = progress, now
            elif progress and launch.stall_timeout_s and now - last_change > launch.stall_timeout_s:
                from pipeline.launch.local import _describe_stall

                raise TrainingStalled(_describe_stall(beats, now - last_change, launch.stall_timeout_s))
            time.sleep(POLL_S)

    def _failure(self, spec: JobSpec, m: Manifests, failed: dict, ended, logs: LogStreams) -> Exception:
        from pipeline.launch.local import rank_failure

        logs.join(timeout_s=10, pods=[pod for pod, _ in failed.values()])  # the failed pods' last lines first
        user_error = reported_user_error(spec.files.errors)
        if user_error is not None:
            return user_error  # bad config or data: no restart, no retry
        if failed:
            node, (pod, how) = min(failed.items())
            what = f"node {node} (pod {pod}) {how}"
        else:
            what = f"the Job failed ({ended[1]})"
        traceback = rank_failure(spec.files.logs(spec.try_number))
        return TrainingFailed(f"Job {m.name}: {what}" + (f"\n{traceback}" if traceback else ""))

    def _check_stopped(self) -> None:
        if self._stopped.is_set():
            raise TrainingFailed("the training job was stopped (the task was killed, cleared or timed out)")

    def _teardown(self, cluster: Cluster, m: Manifests, grace_period_s: int) -> None:
        with self._teardown_lock:
            cluster.delete(m, grace_period_s)
            if not cluster.wait_gone(m, timeout_s=grace_period_s + GONE_TIMEOUT_S):
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


def start_guard(cluster: Cluster, m: Manifests) -> subprocess.Popen | None:
    """A process of its own session that deletes the Job and Service if this process dies without
    saying it is done (SIGKILL, a killed worker): its stdin closes."""
    request = {"client": client_settings(cluster.client), "namespace": m.namespace, "name": m.name}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.launch.kube_guard"], stdin=subprocess.PIPE,
                            start_new_session=True, text=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    return proc


def stop_guard(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.stdin is None:
        return
    try:
        proc.stdin.write("done\n")
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
