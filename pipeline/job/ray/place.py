"""The Ray place (``launch.kind = ray``): each attempt is one Ray job, submitted through the Ray Jobs API, under
the supervisor's policy (``pipeline.job.supervisor``).

- The cluster: ``launch.ray.address`` or the host of the Airflow connection ``launch.ray.connection_id``
  (its password, or ``token`` in its extra, goes as Ray's bearer token); without either, a local cluster
  started for the task (``pipeline.job.ray.cluster``) and stopped with each attempt.
- The job: its ``submission_id`` is the attempt's id (DAG run, task, try and restart), so a retry or a restart
  never submits a duplicate; a job of the same id left by a dead worker is stopped and replaced. Its
  ``runtime_env`` carries the ranks' environment (``Attempt.env``: the job folder, MLflow's URI and run
  id); variables that look like secrets are left out: the cluster's own environment must provide them.
  Its driver is ``pipeline.job.ray.entry`` (Ray Train over the same entry as a torchrun rank).
- Logs: the driver's log (every worker's lines, each with its ``[rank N]:`` prefix) is streamed into the
  task log as it is written; at the job's end, what the stream has not brought yet is read at once (``JobLog``).
- Endings: ``stop`` stops the job (``stop_job``, never ``delete_job``, which a running job refuses) and
  waits until it has ended, whatever ended the attempt; ``pipeline.job.ray.orphan_guard`` does the same when
  the task process dies unannounced.
- Restarts: Ray Train restarts no worker (``pipeline.job.ray.entry``): a worker's failure ends the job, and the
  supervisor restarts the run as on every place, with a new job that resumes from the job folder's checkpoints.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from pipeline import deployment, storage
from pipeline.errors import ConfigError
from pipeline.job import orphan_guard
from pipeline.job.places import Clusters
from pipeline.job.ray.cluster import LocalCluster, cluster_state, jobs_client
from pipeline.job.mirror import JobStore
from pipeline.job.policy import Ended
from pipeline.job.spec import Attempt, JobSpec, without_secrets
from pipeline.job_files import JOB_STORE_ENV

log = logging.getLogger(__name__)

POLL_S = 1.0
STOP_TIMEOUT_S = 60.0
RAY_MONITOR_PERIOD_S = 2.0  # twice the period of Ray's job monitor (JobManager.JOB_MONITOR_LOOP_PERIOD_S)
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def cluster_of(spec: JobSpec, clusters: Clusters) -> tuple[str | None, str | None]:
    """(address, token) of the configured cluster; address None: a local cluster for the task."""
    address, token = clusters.ray(spec.launch.ray.connection_id)
    return spec.launch.ray.address or address, token


def run_name(spec: JobSpec) -> str:
    """The Ray Train run's name: the run key (DAG, run, task and map index), the same on every try and restart."""
    import hashlib

    labels = spec.labels
    key = json.dumps([labels.get(k) for k in ("dag_id", "run_id", "task_id", "map_index")] + [str(spec.files.root)])
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{labels.get('dag_id', 'job')}-{labels.get('task_id', 'run')}")
    return f"{readable[:60]}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def job_request(attempt: Attempt, *, local: bool) -> dict[str, Any]:
    """The Jobs API's ``submit_job`` arguments for one attempt."""
    spec = attempt.spec
    env, _ = without_secrets(attempt.env())  # runtime_env is stored with the job and shown by the dashboard
    env["RAY_DEDUP_LOGS"] = "0"  # the ranks' lines differ only in their rank: none may be folded away
    env["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"  # print() stays print(): once per line, with the rank's prefix
    env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = f"{spec.launch.ray.worker_start_timeout_s:g}"  # read by the controller
    if local:  # the cluster runs this checkout: its workers import the project from here
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(deployment.PROJECT_ROOT)]))
    job = {"launch": dataclasses.asdict(spec.launch), "run_name": run_name(spec), "storage": str(spec.files.checkpoints / "ray"),
           "job_dir": str(spec.files.root), "no_python": spec.no_python}
    store = JobStore.for_job(spec.job_dir, spec.launch.kind)
    if store:  # nodes that share no folder: Ray Train's storage and the job folder's copy on the object store
        job |= {"storage": storage.join(store.uri, "ray"), "store": store.uri}
        env[JOB_STORE_ENV] = store.uri
    python = spec.launch.ray.python or (sys.executable if local else "python")
    entrypoint = shlex.join([python, "-m", "pipeline.job.ray.entry", "--job", json.dumps(job), "--", *spec.entry])
    return {"entrypoint": entrypoint, "submission_id": attempt.id, "runtime_env": {"env_vars": env},
            "metadata": {k: str(v) for k, v in spec.labels.items()}, "entrypoint_num_cpus": 0}


class RayPlace:
    """``launch.kind = ray`` (see the module's description). ``submit``, ``handle``, ``teardown`` and
    ``watch`` are what the deferred form (``pipeline.airflow.deferred``) uses."""

    watch = "pipeline.job.ray.watch:RayJobWatch"
    poll_s = POLL_S

    def __init__(self, spec: JobSpec, clusters: Clusters):
        self.spec = spec
        self.address, self.token = cluster_of(spec, clusters)
        if spec.launch.ray.deferrable and not self.address:
            raise ConfigError("launch.ray.deferrable needs a cluster that outlives the task (launch.ray.address or "
                              f"the connection {spec.launch.ray.connection_id!r}): a local one lives in the task")
        self._client = None
        self._local: LocalCluster | None = None
        self._current: str | None = None
        self._guard: subprocess.Popen | None = None
        self._log: JobLog | None = None
        self._lock = threading.Lock()

    @property
    def client(self):
        if self._client is None:
            self._client = jobs_client(self.address, self.token)
        return self._client

    def submit(self, attempt: Attempt, emit: Callable[[str], None]) -> str:
        """Submit the attempt's job (stopping and replacing one of the same id that a dead worker left)."""
        request = job_request(attempt, local=self._local is not None)
        sid, launch = request["submission_id"], self.spec.launch
        left = _status(self.client, sid)
        if left is not None:
            emit(f"Ray job {sid} exists already ({left}: left by a worker of this attempt that died): replacing it")
            stop_job(self.client, sid, STOP_TIMEOUT_S)
            release_job_id(self.client, self.address, self.token, sid)
        emit(f"submitting Ray job {sid} to {self.address}: {launch.nnodes * launch.nproc_per_node} Ray Train "
             f"worker(s) of {launch.ray.cpus_per_worker:g} CPU" + (" and 1 GPU" if launch.gpus_per_node else "") + " each")
        self.client.submit_job(**request)
        return sid

    def handle(self, attempt: Attempt) -> dict[str, Any]:
        """What the triggerer needs to watch the attempt (JSON; the token is looked up there, never stored)."""
        return {"address": self.address, "connection_id": self.spec.launch.ray.connection_id,
                "submission_id": attempt.id, "start_timeout_s": self.spec.launch.ray.start_timeout_s}

    def teardown(self, attempt: Attempt, grace_period_s: float) -> None:
        stop_job(self.client, attempt.id, grace_period_s + STOP_TIMEOUT_S)

    def start(self, attempt: Attempt, emit: Callable[[str], None]) -> None:
        with self._lock:
            if self.address is None or self._local is not None:
                self._local = LocalCluster(cpus=self.spec.launch.ray.local_cpus,
                                           grace_period_s=self.spec.launch.grace_period_s)
                self.address, self._client = self._local.start(emit), None
            elif self._guard is None:
                self._guard = orphan_guard.start_guard("pipeline.job.ray.orphan_guard", {
                    "address": self.address, "token": self.token, "submission_id": attempt.id})
            self._current = attempt.id
        self._emit = emit
        self._submitted = time.monotonic()
        self._running = False
        self.submit(attempt, emit)
        self._log = JobLog(self.client, attempt.id, emit)
        threading.Thread(target=asyncio.run, args=(self._log.follow(),), daemon=True, name=f"ray-logs-{attempt.id}").start()

    def poll(self) -> Ended | None:
        sid = self._current
        if sid is None:
            return Ended("stopped")
        try:
            info = self.client.get_job_info(sid)
        except Exception as exc:  # the cluster went away (a local head killed, a network partition)
            return Ended("failed", f"the Ray cluster at {self.address} stopped answering about job {sid}: {exc}")
        end = job_end(info, sid, pending_s=time.monotonic() - self._submitted,
                      start_timeout_s=self.spec.launch.ray.start_timeout_s)
        if end is None and not self._running and _status_of(info) == "RUNNING":
            self._emit(f"Ray job {sid} is running")
            self._running = True
        if end is not None and self._log is not None:
            self._log.finish()  # the last lines before the verdict
        return end

    def stop(self, grace_period_s: float) -> None:
        with self._lock:
            sid, self._current = self._current, None
            guard_proc, self._guard = self._guard, None
            local = self._local
            answers = local is None or local.proc is not None  # a local head that died answers nothing
            if sid is not None and answers:
                try:
                    stop_job(self.client, sid, grace_period_s + STOP_TIMEOUT_S)
                except Exception as exc:
                    log.warning("stopping Ray job %s failed: %s", sid, exc)
            if self._log is not None and answers:
                self._log.finish()  # the job has ended: its last lines
            if local is not None:
                local.stop()
                self.address, self._client = None, None
        orphan_guard.stop_guard(guard_proc)

    def dump_stacks(self, beats: dict, emit: Callable[[str], None]) -> None:
        """A local cluster's ranks are processes of this machine: they print their stacks as local ranks do."""
        if self._local is not None:
            from pipeline.job.local.place import dump_local_stacks

            dump_local_stacks(beats)


def job_end(info, sid: str, *, pending_s: float, start_timeout_s: float) -> Ended | None:
    """How a Ray job (its ``JobDetails``) ended, None while it runs or waits within ``start_timeout_s``."""
    status = _status_of(info)
    if status == "PENDING":
        if pending_s > start_timeout_s:
            return Ended("not_started", f"Ray job {sid} was not running within launch.ray.start_timeout_s="
                                        f"{start_timeout_s:g}s: {info.message or 'pending'}")
        return None
    if status == "RUNNING":
        return None
    if status == "SUCCEEDED":
        return Ended("succeeded", f"Ray job {sid} succeeded")
    if status == "STOPPED":
        return Ended("stopped", f"Ray job {sid} was stopped outside this task")
    return Ended("failed", f"Ray job {sid} failed: {info.message or status}")


def _status_of(info) -> str:
    return str(getattr(info.status, "value", info.status))


def _status(client, sid: str) -> str | None:
    """The job's status, None when there is no job of that id."""
    try:
        return str(client.get_job_status(sid).value)
    except RuntimeError as exc:
        if "does not exist" in str(exc) or "404" in str(exc):
            return None
        raise


def stop_job(client, sid: str, timeout_s: float) -> None:
    """Stop the job and wait until Ray says it has ended (``stop_job`` of an ended job is a no-op)."""
    if _status(client, sid) in TERMINAL | {None}:
        return
    client.stop_job(sid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _status(client, sid) in TERMINAL | {None}:
            return
        time.sleep(0.5)
    log.warning("Ray job %s still not ended %gs after stop_job", sid, timeout_s)


def release_job_id(client, address: str, token: str | None, sid: str) -> None:
    """Free the id of the ended job ``sid`` for a new job. Ray's job manager watches each job in a loop of a
    second (its status, then its supervisor actor), and the supervisor actor writes the job's end before it
    exits: a job submitted under the same id before that loop has seen the end, or before the actor is gone,
    is watched by the old loop, which sees the old actor exit and fails the new job ("Job supervisor actor
    died")."""
    from ray.dashboard.modules.job.common import JOB_ACTOR_NAME_TEMPLATE

    time.sleep(RAY_MONITOR_PERIOD_S)
    client.delete_job(sid)
    name, deadline = JOB_ACTOR_NAME_TEMPLATE.format(job_id=sid), time.monotonic() + STOP_TIMEOUT_S
    while any(actor["state"] != "DEAD" for actor in cluster_state(address, token, "actors", name=name)):
        if time.monotonic() > deadline:
            log.warning("the supervisor actor of Ray job %s still not gone %gs after the job's end", sid, STOP_TIMEOUT_S)
            return
        time.sleep(0.2)


class JobLog:
    """A Ray job's log into ``emit``, line by line without Ray's terminal colours: streamed over the Jobs API's
    websocket as the driver writes it (``follow``), and once the job has ended completed from the whole log,
    read once (``finish``), instead of waiting for the stream to close: the Jobs API's tail reads to the end
    of the file once more after it has seen the job's end, a second or two of sleeps per read. A stream that
    breaks (the job deleted, the cluster gone) is said in the log: it is not the attempt's end."""

    def __init__(self, client, sid: str, emit: Callable[[str], None]):
        self.client, self.sid, self.emit = client, sid, emit
        self._received = 0  # characters of the log taken from the stream
        self._pending = ""  # the last line, while its end is not yet received
        self._done = False
        self._lock = threading.Lock()

    async def follow(self) -> None:
        try:
            async for chunk in self.client.tail_job_logs(self.sid):
                if not self._take(chunk):
                    return
        except Exception as exc:  # what it did not bring, ``finish`` reads
            with self._lock:
                if not self._done:
                    self.emit(f"(the Ray job's log stream ended: {type(exc).__name__}: {exc})")
            return
        self._take("", last=True)  # the Jobs API closes the stream after the job's end: it brought every line

    def finish(self) -> None:
        """Emit what the stream has not of the ended job's log (nothing once the stream itself has ended)."""
        if self._done:
            return
        try:
            text = self.client.get_job_logs(self.sid)
        except Exception as exc:
            text = ""
            self.emit(f"(the Ray job's last log lines could not be read: {type(exc).__name__}: {exc})")
        self._take(text, whole=True, last=True)

    def _take(self, text: str, *, whole: bool = False, last: bool = False) -> bool:
        """Emit the complete lines of ``text`` (the next chunk, or with ``whole`` the log from its start);
        False once the log has been emitted to its end."""
        with self._lock:
            if self._done:
                return False
            if whole:
                text = text[self._received:]
            self._received += len(text)
            *lines, self._pending = (self._pending + text).split("\n")
            if last and self._pending:
                lines.append(self._pending)
            self._done = last
            for line in lines:
                self.emit(ANSI_ESCAPE.sub("", line))
            return not self._done
