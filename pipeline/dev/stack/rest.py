"""Talking to the stack's services over HTTP: Airflow's REST API with a token, and health probes."""

from __future__ import annotations

import json
import time
import urllib.request


class RestClient:
    """Airflow's REST API with a token from ``/auth/token``."""

    def __init__(self, url: str, username: str, password: str):
        self.url, self.username, self.password = url.rstrip("/"), username, password
        self._token: str | None = None

    def token(self) -> str:
        if self._token is None:
            body = json.dumps({"username": self.username, "password": self.password}).encode()
            req = urllib.request.Request(f"{self.url}/auth/token", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as response:
                self._token = json.loads(response.read())["access_token"]
        return self._token

    def request(self, method: str, path: str, payload=None) -> dict:
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {self.token()}"})
        with urllib.request.urlopen(req, timeout=60) as response:
            return json.loads(response.read() or b"{}")


def fail_running_tasks(client: RestClient, wait_s: float) -> int:
    """Mark every running task instance failed (Airflow then ends its process); returns how many."""
    running = client.request("GET", "/api/v2/dags/~/dagRuns/~/taskInstances?state=running&limit=100")
    tis = running.get("task_instances", [])
    for ti in tis:
        path = f"/api/v2/dags/{ti['dag_id']}/dagRuns/{ti['dag_run_id']}/taskInstances/{ti['task_id']}"
        if ti.get("map_index", -1) >= 0:
            path += f"/{ti['map_index']}"
        client.request("PATCH", path, {"new_state": "failed"})
    deadline = time.monotonic() + wait_s
    while tis and time.monotonic() < deadline:
        still = client.request("GET", "/api/v2/dags/~/dagRuns/~/taskInstances?state=running&limit=1")
        if not still.get("task_instances"):
            break
        time.sleep(0.5)
    return len(tis)


def http_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None
