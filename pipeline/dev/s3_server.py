"""An S3 API server on 127.0.0.1 for development, tests and benchmarks: moto's server mode (``moto[server]``, the
server s3fs and MLflow run their own S3 tests against), in a process of its own. Every client the pipeline uses
(s3fs, boto3 under streaming's downloader, MLflow's artifact store) reaches it through ``AWS_ENDPOINT_URL``, exactly
as it would reach S3 or MinIO. It keeps its objects in memory: stopped, they are gone. Deployments use a real object
store (``docker-compose.yml`` runs MinIO)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from pipeline.network import free_ports


class S3Server:
    """One server on a free port; ``env()`` is what a client process needs to reach it."""

    REGION = "us-east-1"

    def __init__(self, log_dir: Path, *, deny_all: bool = False):
        # deny_all: moto's IAM checks on from the first request (INITIAL_NO_AUTH_ACTION_COUNT=0), with no user made,
        # so every request is refused as S3 refuses a key it does not know (403): a store the credentials cannot use.
        self.deny_all = deny_all
        self.port = free_ports(1)[0]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"s3-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        # moto takes any key pair; these stand in for a deployment's own, and tests look for them where none may be.
        self.access_key, self.secret_key = f"AKIA{uuid.uuid4().hex[:16].upper()}", uuid.uuid4().hex + uuid.uuid4().hex

    def env(self) -> dict[str, str]:
        """What a process needs to reach this store, as it would a deployment's."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": self.REGION}

    def start(self, timeout_s: float = 60) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = os.environ | ({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if self.deny_all else {})
        self.proc = subprocess.Popen(command(self.port), stdout=open(self.log_path, "a"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        wait_answering(self.endpoint, lambda: self.proc.poll() is not None, self.log_path, timeout_s)

    def bucket(self, name: str) -> str:
        """Create the bucket ``name``; its URI."""
        return create_bucket(self.endpoint, self.access_key, self.secret_key, name)

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None


def command(port: int) -> list[str]:
    """moto's server on ``127.0.0.1:port``."""
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


def wait_answering(endpoint: str, exited, log_path: Path, timeout_s: float) -> None:
    """Until the server at ``endpoint`` answers; ``exited()`` says its process has ended (see ``log_path``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if exited():
            raise RuntimeError(f"the S3 server exited; see {log_path}")
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the S3 server did not answer within {timeout_s}s; see {log_path}")


def create_bucket(endpoint: str, access_key: str, secret_key: str, name: str) -> str:
    """The bucket ``name`` at ``endpoint``, created unless it exists; its URI."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name=S3Server.REGION, aws_access_key_id=access_key,
                          aws_secret_access_key=secret_key)
    try:
        client.create_bucket(Bucket=name)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return f"s3://{name}"
