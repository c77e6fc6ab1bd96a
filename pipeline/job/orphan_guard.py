"""Guards for places whose attempts live outside the task's process tree (a Kubernetes Job, a Ray job).

The supervisor starts ``python -m <guard module>`` in a session of its own (a kill of the task's process
group does not reach it) and writes one JSON line naming what to tear down. It writes ``done`` when it
has torn the attempt down itself; if stdin closes without it (the task process was SIGKILLed, the worker
died), the guard tears the attempt down. The local place needs none of this: its attempt is a child of
``pipeline.job.local.process_group``, which the kernel signals when the task process dies.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def start_guard(module: str, request: dict[str, Any]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, start_new_session=True, text=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    return proc


def stop_guard(proc: subprocess.Popen | None) -> None:
    """The attempt is torn down: the guard exits without acting."""
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


def orphaned_request() -> dict[str, Any] | None:
    """In the guard: the supervisor's request once stdin closes without ``done`` (act on it), or None."""
    request = json.loads(sys.stdin.readline())
    for line in sys.stdin:
        if line.strip() == "done":
            return None
    return request
