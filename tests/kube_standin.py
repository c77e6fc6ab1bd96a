"""A stand-in Kubernetes API server for the launcher's lifecycle tests: no real API server (nor kubelet,
scheduler or Job controller) can run on the project's machines.

It speaks the official client's REST paths for what the launcher uses - jobs (create, get, delete),
services (create, delete), pods (list by label selector) and pods/log (follow, chunked as the real
server streams it) - keeps objects as the API's JSON, and records every request. A *scenario* plays
the cluster's part for each Job created: it makes the Job's indexed pods and moves them through their
phases (unschedulable, image pull back-off, running, failed, succeeded), writes their log lines, and
may write into the shared job folder what the ranks would (rank 0's result, a user error).
Foreground deletion removes the pods first, then the Job.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, urlparse

from pipeline.job.kubernetes.manifest import COMPLETION_INDEX, Manifests

INDEX = "batch.kubernetes.io/job-completion-index"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message, "code": code}


class StandinCluster:
    def __init__(self, scenario: Callable[["StandinCluster", dict], None]):
        self.scenario = scenario
        self.lock = threading.Condition()
        self.jobs: dict[str, dict] = {}
        self.services: dict[str, dict] = {}
        self.pods: dict[str, dict] = {}
        self.logs: dict[str, list[str]] = {}
        self.requests: list[tuple[str, str]] = []  # (verb, resource) as RBAC names them
        self.deletions: list[dict] = []  # (kind, name, propagationPolicy)
        self.created_jobs: list[dict] = []
        self.open_streams = 0
        self.max_open_streams = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    # ----- the test's side
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def kube_config(self) -> dict:
        return {"apiVersion": "v1", "kind": "Config", "current-context": "standin",
                "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
                "users": [{"name": "launcher", "user": {"token": "standin-token"}}],
                "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "launcher"}}]}

    def connection_env(self, conn_id: str) -> dict[str, str]:
        """An Airflow connection (the Kubernetes provider's) pointing at this server."""
        return {f"AIRFLOW_CONN_{conn_id.upper()}": json.dumps({"conn_type": "kubernetes",
                                                                "extra": {"kube_config": self.kube_config()}})}

    def __enter__(self) -> "StandinCluster":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 30) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(min(left, 0.2))
        return True

    def left_behind(self) -> list[str]:
        with self.lock:
            return sorted([f"job/{k}" for k in self.jobs] + [f"service/{k}" for k in self.services]
                          + [f"pod/{k}" for k in self.pods])

    # ----- the scenario's side (the cluster's controllers and kubelet)
    def alive(self, job: dict) -> bool:
        with self.lock:
            return self._key(job) in self.jobs

    def make_pods(self, job: dict) -> list[str]:
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        template = job["spec"]["template"]
        names = []
        with self.lock:
            for index in range(job["spec"]["completions"]):
                pod_name = f"{name}-{index}-x{index}z"
                annotations = {**template["metadata"].get("annotations", {}), INDEX: str(index)}
                labels = {**template["metadata"].get("labels", {}), INDEX: str(index), "job-name": name}
                self.pods[f"{ns}/{pod_name}"] = {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": pod_name, "namespace": ns, "labels": labels, "annotations": annotations,
                                 "creationTimestamp": _now()},
                    "spec": template["spec"],
                    "status": {"phase": "Pending"},
                }
                self.logs[f"{ns}/{pod_name}"] = []
                names.append(f"{ns}/{pod_name}")
            self.lock.notify_all()
        return names

    def set_pod(self, key: str, phase: str, *, unschedulable: str | None = None, waiting: tuple[str, str] | None = None,
                exit_code: int | None = None, message: str = "") -> None:
        with self.lock:
            pod = self.pods.get(key)
            if pod is None:
                return
            image = pod["spec"]["containers"][0]["image"]
            status: dict = {"phase": phase}
            state: dict | None = None
            if unschedulable:
                status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                         "message": unschedulable}]
            if waiting:
                state = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
            elif phase == "Running":
                state = {"running": {"startedAt": _now()}}
            elif phase in ("Succeeded", "Failed"):
                state = {"terminated": {"exitCode": exit_code or 0, "reason": "Completed" if phase == "Succeeded" else "Error",
                                        "message": message or None, "finishedAt": _now()}}
            if state is not None:
                status["containerStatuses"] = [{"name": "torchrun", "image": image, "imageID": "", "ready": phase == "Running",
                                                "restartCount": 0, "state": state}]
            pod["status"] = status
            self.lock.notify_all()

    def log(self, key: str, line: str) -> None:
        with self.lock:
            if key in self.logs:
                self.logs[key].append(line)
                self.lock.notify_all()

    def end_job(self, job: dict, condition: str, reason: str = "", message: str = "") -> None:
        with self.lock:
            stored = self.jobs.get(self._key(job))
            if stored is not None:
                stored["status"] = {"conditions": [{"type": condition, "status": "True", "reason": reason, "message": message}]}
                self.lock.notify_all()

    def pod_env(self, job: dict) -> dict[str, str]:
        container = job["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value", "") for e in container["env"]}

    # ----- HTTP
    @staticmethod
    def _key(obj: dict) -> str:
        return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"

    def _delete_job(self, key: str, policy: str | None) -> None:
        def foreground():
            time.sleep(0.1)
            with self.lock:
                for pod_key in [k for k, p in self.pods.items() if p["metadata"]["labels"].get("job-name") == key.split("/")[1]]:
                    self.pods.pop(pod_key)
                self.lock.notify_all()
            time.sleep(0.05)
            with self.lock:
                self.jobs.pop(key, None)
                self.lock.notify_all()

        with self.lock:
            self.jobs[key]["metadata"]["deletionTimestamp"] = _now()
        threading.Thread(target=foreground, daemon=True).start()

    def _handler(self):
        cluster = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"{}")

            def _route(self):
                url = urlparse(self.path)
                m = re.fullmatch(r"/(?:api/v1|apis/batch/v1)/namespaces/([^/]+)/(jobs|services|pods)(?:/([^/]+))?(/log)?", url.path)
                if not m:
                    return None
                ns, kind, name, log = m.groups()
                return ns, kind, name, bool(log), {k: v[0] for k, v in parse_qs(url.query).items()}

            def do_POST(self):
                ns, kind, _, _, _ = self._route()
                body = self._body()
                body["metadata"].setdefault("namespace", ns)
                key = f"{ns}/{body['metadata']['name']}"
                store = cluster.jobs if kind == "jobs" else cluster.services
                with cluster.lock:
                    cluster.requests.append(("create", kind))
                    if key in store:
                        return self._send(409, _status(409, "AlreadyExists", f'{kind} "{body["metadata"]["name"]}" already exists'))
                    body["metadata"].update(uid=f"uid-{len(cluster.requests)}", creationTimestamp=_now())
                    body.setdefault("status", {})
                    store[key] = body
                    if kind == "jobs":
                        cluster.created_jobs.append(json.loads(json.dumps(body)))
                    cluster.lock.notify_all()
                if kind == "jobs":
                    threading.Thread(target=cluster.scenario, args=(cluster, body), daemon=True).start()
                self._send(201, body)

            def do_GET(self):
                ns, kind, name, log, query = self._route()
                if kind == "pods" and log:
                    return self._stream_log(f"{ns}/{name}", query)
                with cluster.lock:
                    if name is None:
                        cluster.requests.append(("list", kind))
                        selector = dict(item.split("=", 1) for item in query.get("labelSelector", "").split(",") if item)
                        items = [p for k, p in cluster.pods.items() if k.startswith(ns + "/")
                                 and all(p["metadata"]["labels"].get(a) == b for a, b in selector.items())]
                        return self._send(200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})
                    cluster.requests.append(("get", kind))
                    store = {"jobs": cluster.jobs, "services": cluster.services, "pods": cluster.pods}[kind]
                    obj = store.get(f"{ns}/{name}")
                    if obj is None:
                        return self._send(404, _status(404, "NotFound", f'{kind} "{name}" not found'))
                    return self._send(200, obj)

            def do_DELETE(self):
                ns, kind, name, _, _ = self._route()
                body = self._body()
                key = f"{ns}/{name}"
                with cluster.lock:
                    cluster.requests.append(("delete", kind))
                    cluster.deletions.append({"kind": kind, "name": name, "propagationPolicy": body.get("propagationPolicy")})
                    store = cluster.jobs if kind == "jobs" else cluster.services
                    if key not in store:
                        return self._send(404, _status(404, "NotFound", f'{kind} "{name}" not found'))
                    if kind == "services":
                        obj = store.pop(key)
                        cluster.lock.notify_all()
                        return self._send(200, obj)
                    obj = store[key]
                cluster._delete_job(key, body.get("propagationPolicy"))
                self._send(200, obj)

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _stream_log(self, key: str, query: dict) -> None:
                with cluster.lock:
                    cluster.requests.append(("get", "pods/log"))
                    if key not in cluster.pods or key not in cluster.logs:
                        return self._send(404, _status(404, "NotFound", f"pod {key} not found"))
                    cluster.open_streams += 1
                    cluster.max_open_streams = max(cluster.max_open_streams, cluster.open_streams)
                    cluster.lock.notify_all()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                sent = 0
                try:
                    while True:
                        with cluster.lock:
                            lines = cluster.logs.get(key, [])[sent:]
                            pod = cluster.pods.get(key)
                            ended = pod is None or pod["status"]["phase"] in ("Succeeded", "Failed")
                            if not lines and not ended:
                                cluster.lock.wait(0.2)
                                continue
                        for line in lines:
                            self._chunk(line.encode() + b"\n")
                        sent += len(lines)
                        if ended and not lines:
                            break
                    self._chunk(b"")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with cluster.lock:
                        cluster.open_streams -= 1

        return Handler


# ----- scenarios: what the cluster does with each Job


def nodes_run(cluster: StandinCluster, job: dict, *, lines: int = 3, fail_node: int | None = None,
              user_error: bool = False, forever: bool = False, result: dict | None = None,
              on_success: Callable[[dict], None] | None = None, stalled: bool = False,
              autoscaled_away: bool = False, preempt_first: bool = False) -> None:
    """Every pod schedules and runs; node k logs ``step i`` lines, both nodes at once (a node writes its
    next line only once the other's previous one was served); then all succeed (rank 0 writes its result),
    ``fail_node`` fails (optionally reporting a user error first), or they run until deleted.
    ``preempt_first``: the first attempt's pods are evicted (the ranks checkpoint, mark the preemption
    and exit with its code); a later attempt runs to the end."""
    pods = cluster.make_pods(job)
    time.sleep(0.2)
    for key in pods:
        cluster.set_pod(key, "Running")
    if autoscaled_away:  # pod 1's node is scaled down as it finishes: the pod was listed, its log is gone
        with cluster.lock:
            cluster.logs.pop(pods[1], None)
    else:
        cluster.wait_for(lambda: cluster.open_streams >= len(pods) or not cluster.alive(job), 20)
    env = cluster.pod_env(job)
    if stalled:  # rank 0 reports step 5 once, then no step completes
        progress = Path(env["PIPELINE_PROGRESS_DIR"])
        progress.mkdir(parents=True, exist_ok=True)
        (progress / "rank-0.json").write_text(json.dumps({"rank": 0, "pid": 1, "step": 5, "total": 100, "epoch": 0,
                                                          "phase": "training", "time": time.time()}))
    step = 0
    while cluster.alive(job) and (forever or step < lines):
        for node, key in enumerate(pods):
            cluster.log(key, f"[rank {node}] step {step}")
        step += 1
        time.sleep(0.1)
    if not cluster.alive(job):
        return
    if preempt_first and job["metadata"]["name"].endswith("-r0"):
        from pipeline.job_files import PREEMPTED_EXIT_CODE, mark_preempted

        mark_preempted(Path(env["PIPELINE_PROGRESS_DIR"]), rank=0, step=7)
        for key in pods:
            cluster.log(key, "SIGTERM: checkpointed at step 7")
            cluster.set_pod(key, "Failed", exit_code=PREEMPTED_EXIT_CODE, message="preempted at step 7")
        time.sleep(0.3)
        cluster.end_job(job, "Failed", "PodFailurePolicy", "a pod was evicted")
        return
    if fail_node is not None:
        if user_error:
            errors = Path(env["PIPELINE_ERROR_DIR"])
            errors.mkdir(parents=True, exist_ok=True)
            rank = fail_node * int(env["PET_NPROC_PER_NODE"])
            (errors / f"rank-{rank}.json").write_text(json.dumps(
                {"rank": rank, "type": "DataError", "message": "shard 3, row 17: label 'x' is not a class"}))
        cluster.log(pods[fail_node], "Traceback (most recent call last):\nRuntimeError: boom")
        cluster.set_pod(pods[fail_node], "Failed", exit_code=1, message="RuntimeError: boom")
        time.sleep(0.3)
        cluster.end_job(job, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
        return
    Path(env["PIPELINE_RESULT_FILE"]).write_text(json.dumps(result or {
        "final_loss": 0.25, "nodes": len(pods), "restart": int(env["PIPELINE_RESTART_COUNT"])}))
    if on_success is not None:
        on_success(job)
    for key in pods:
        cluster.set_pod(key, "Succeeded")
    cluster.end_job(job, "Complete", "", "")


def unschedulable(cluster: StandinCluster, job: dict) -> None:
    for key in cluster.make_pods(job):
        cluster.set_pod(key, "Pending", unschedulable="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")


def image_pull_backoff(cluster: StandinCluster, job: dict) -> None:
    pods = cluster.make_pods(job)
    cluster.set_pod(pods[0], "Running")
    image = job["spec"]["template"]["spec"]["containers"][0]["image"]
    cluster.set_pod(pods[1], "Pending", waiting=("ImagePullBackOff", f'Back-off pulling image "{image}"'))


def crash_before_start(cluster: StandinCluster, job: dict) -> None:
    pods = cluster.make_pods(job)
    cluster.set_pod(pods[0], "Pending", waiting=("ContainerCreating", ""))
    cluster.set_pod(pods[1], "Failed", exit_code=127, message="exec: python: not found")


def rendered_pod(manifests: Manifests, index: int) -> tuple[list[str], dict[str, str]]:
    """What pod ``index`` runs: its command and environment as the kubelet makes them (the completion
    index filled in from the annotation, ``$(VAR)`` references expanded). Secrets are not resolved."""
    container = manifests.job.spec.template.spec.containers[0]
    env: dict[str, str] = {}
    for var in container.env:
        if var.value_from is not None:
            if var.value_from.field_ref is None or COMPLETION_INDEX not in var.value_from.field_ref.field_path:
                raise ValueError(f"cannot render {var.name}: only the completion index is known outside a cluster")
            env[var.name] = str(index)
        else:
            env[var.name] = _expand(var.value, env)
    return [_expand(arg, env) for arg in container.command], env


def _expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion: a defined variable is replaced, ``$$`` escapes, others stay."""
    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", replace, text)
