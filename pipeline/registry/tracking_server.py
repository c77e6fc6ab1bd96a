"""An MLflow tracking server for one job, where the ranks run a different MLflow than this process.

A toolchain's environment (``pipeline.toolchains``) brings its own MLflow client, often another release
(LLM Foundry's is 2.x). A database store (``sqlite:``, ``postgresql:``) accepts only clients of its own schema
version, but the REST API serves every release: so when the tracking URI is not already a server's, the ranks
get one, started for the job on 127.0.0.1 over the same store and artifact root, and stopped after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from pipeline import deployment
from pipeline.errors import InfraError
from pipeline.network import free_ports, http_ok

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
# Every MLflow server the pipeline starts (a job's here, the local stack's, the tests') runs without MLflow's
# server-side jobs (GenAI evaluation, trace roll-ups), which the pipeline never submits: their eight worker
# processes, about 3 s of start-up, and a folder in /dev/shm that outlives the server.
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def is_server(uri: str) -> bool:
    return uri.split(":", 1)[0] in ("http", "https", "databricks")


@contextlib.contextmanager
def served(uri: str, log_file: Path) -> Iterator[str]:
    """``uri`` itself when it is a server's; otherwise the URL of an ``mlflow server`` over it, alive while the
    block runs (its output in ``log_file``)."""
    if is_server(uri):
        yield uri
        return
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri,
               "--default-artifact-root", deployment.mlflow_artifact_root(), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    log_file.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    env = {**os.environ, **SERVER_ENV}
    with open(log_file, "ab") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, env=env)
    try:
        while not http_ok(f"{url}/health"):
            if server.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                tail = log_file.read_text(errors="replace")[-2000:]
                raise InfraError(f"the job's MLflow tracking server ({' '.join(command)}) did not start: {tail}")
            time.sleep(0.2)
        log.info("MLflow tracking server for the job's ranks at %s (over %s), up in %.1f s", url, uri,
                 time.monotonic() - started)
        yield url
    finally:
        _stop(server)


def _stop(server: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if server.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(wait_s)


@contextlib.contextmanager
def for_ranks(spec):
    """``spec`` (a ``JobSpec``) as its ranks should see MLflow: a local toolchain job whose tracking URI is a
    store, not a server, gets a server for its duration (the ranks' ``MLFLOW_TRACKING_URI``). A toolchain's job is
    told by its own interpreter (``spec.python``, which ``pipeline.job.spec.resolve`` sets for a local one)."""
    uri = spec.env.get("MLFLOW_TRACKING_URI") or deployment.mlflow_tracking_uri()
    if spec.python is None or spec.launch.kind != "local" or is_server(uri):
        yield spec
        return
    import dataclasses

    with served(uri, spec.files.root / "mlflow-server.log") as url:
        yield dataclasses.replace(spec, env={**spec.env, "MLFLOW_TRACKING_URI": url})
