"""Local ports and HTTP health checks, for the services the pipeline starts on this machine (a Ray head, the
dev stack, a job's MLflow tracking server)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free now (held open together while chosen, so none is picked twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def http_ok(url: str) -> bool:
    """Whether ``url`` answers 200 within 3 seconds."""
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status == 200
    except (OSError, urllib.error.HTTPError):
        return False
