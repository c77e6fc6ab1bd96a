"""A stand-in Kubernetes API server for the launcher's lifecycle tests: no real API server (nor kubelet,
scheduler or Job controller) can run on the project's machines.

It speaks the official client's REST paths for what the launcher uses - jobs (create, get, delete),
services (create, delete), pods (list by label selector) and pods/log (follow, chunked as the real
server streams it) - keeps objects as the API's JSON, and records every request. A *scenario*
(``tests/kube_scenarios.py``) plays the cluster's part for each Job created, in a thread of its own.
Foreground deletion removes the pods first, then the Job.

Nothing here waits for time to pass: a scenario goes on when the client has seen its last move (the next
list of pods, every open log stream served, the Job deleted), each change wakes whoever waits on the
cluster's condition, and the timeouts only bound a failure.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qs, urlparse

from pipeline.job.kubernetes.manifest import COMPLETION_INDEX, Manifests

INDEX = "batch.kubernetes.io/job-completion-index"
WAIT_S = 30.0  # the bound of a scenario's wait for the client: reached only when the client under test is broken


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
        self.served: dict[str, int] = {}  # log lines written to each pod's open stream
        self.lists_when_played: int | None = None  # pod lists made when the last scenario returned
        self.closed = False
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
        with self.lock:
            self.closed = True  # log streams still open end now
            self.lock.notify_all()
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
        """Whether ``predicate`` (of the cluster's state) came true within ``timeout_s``: every change notifies."""
        with self.lock:
            return self.lock.wait_for(predicate, timeout_s)

    def lists(self) -> int:
        """How many times the client has listed pods."""
        with self.lock:
            return self.requests.count(("list", "pods"))

    def settled(self) -> bool:
        """Whether the client has listed the pods since the last scenario returned: it saw where it left them."""
        with self.lock:
            return self.lists_when_played is not None and self.requests.count(("list", "pods")) > self.lists_when_played

    def left_behind(self) -> list[str]:
        with self.lock:
            return sorted([f"job/{k}" for k in self.jobs] + [f"service/{k}" for k in self.services]
                          + [f"pod/{k}" for k in self.pods])

    # ----- the scenario's side (the cluster's controllers and kubelet)
    def alive(self, job: dict) -> bool:
        with self.lock:
            return self._key(job) in self.jobs

    def until(self, job: dict, predicate: Callable[[], bool] = lambda: False, timeout_s: float = WAIT_S) -> None:
        """A scenario's wait: until ``predicate`` holds, the Job is gone or the server is closed."""
        self.wait_for(lambda: self.closed or self._key(job) not in self.jobs or predicate(), timeout_s)

    def seen(self, job: dict, since: int) -> None:
        """Until the client lists pods once more after ``since`` lists: it has seen every change made before."""
        self.until(job, lambda: self.requests.count(("list", "pods")) > since)

    def logged(self, job: dict, pods: list[str], count: int) -> None:
        """Until every open log stream of ``pods`` has sent its first ``count`` lines."""
        self.until(job, lambda: all(self.served.get(key, count) >= count for key in pods))

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

    def _record(self, verb: str, resource: str) -> None:
        """A request, under the lock: a scenario may be waiting for the client to look again."""
        self.requests.append((verb, resource))
        self.lock.notify_all()

    def _play(self, job: dict) -> None:
        self.scenario(self, job)
        with self.lock:
            self.lists_when_played = self.requests.count(("list", "pods"))
            self.lock.notify_all()

    # ----- HTTP
    @staticmethod
    def _key(obj: dict) -> str:
        return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"

    def _delete_job(self, key: str, policy: str | None) -> None:
        def foreground():  # after the DELETE's answer, as the garbage collector works: the pods, then the Job
            with self.lock:
                for pod_key in [k for k, p in self.pods.items() if p["metadata"]["labels"].get("job-name") == key.split("/")[1]]:
                    self.pods.pop(pod_key)
                self.lock.notify_all()
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
                    cluster._record("create", kind)
                    if key in store:
                        return self._send(409, _status(409, "AlreadyExists", f'{kind} "{body["metadata"]["name"]}" already exists'))
                    body["metadata"].update(uid=f"uid-{len(cluster.requests)}", creationTimestamp=_now())
                    body.setdefault("status", {})
                    store[key] = body
                    if kind == "jobs":
                        cluster.created_jobs.append(json.loads(json.dumps(body)))
                    cluster.lock.notify_all()
                if kind == "jobs":
                    threading.Thread(target=cluster._play, args=(body,), daemon=True).start()
                self._send(201, body)

            def do_GET(self):
                ns, kind, name, log, query = self._route()
                if kind == "pods" and log:
                    return self._stream_log(f"{ns}/{name}", query)
                with cluster.lock:
                    if name is None:
                        cluster._record("list", kind)
                        selector = dict(item.split("=", 1) for item in query.get("labelSelector", "").split(",") if item)
                        items = [p for k, p in cluster.pods.items() if k.startswith(ns + "/")
                                 and all(p["metadata"]["labels"].get(a) == b for a, b in selector.items())]
                        return self._send(200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})
                    cluster._record("get", kind)
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
                    cluster._record("delete", kind)
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
                    cluster._record("get", "pods/log")
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
                            ended = pod is None or pod["status"]["phase"] in ("Succeeded", "Failed") or cluster.closed
                            if not lines and not ended:
                                cluster.lock.wait()  # a new line, a phase, a deletion or the close notifies
                                continue
                        for line in lines:
                            self._chunk(line.encode() + b"\n")
                        sent += len(lines)
                        with cluster.lock:
                            cluster.served[key] = sent
                            cluster.lock.notify_all()
                        if ended and not lines:
                            break
                    self._chunk(b"")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with cluster.lock:
                        cluster.open_streams -= 1
                        cluster.served.pop(key, None)
                        cluster.lock.notify_all()

        return Handler


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
