"""The local stack's Ray head (``make stack RAY=1``): ``python -m pipeline.dev.stack.ray_head --address-file F``
runs the product's ``pipeline.job.ray.cluster.LocalCluster`` (a head on 127.0.0.1 with Ray's token
authentication, under the local guard) for as long as this process lives, like the stack's other services.

The stack starts it first, waits for the address it writes, and points the Airflow connection ``ray_default`` at
it, so runs with ``launch.kind=ray`` train there. ``make stack-down`` ends it by process id as it ends the other
services; on SIGTERM it stops the cluster by process id too (never ``ray stop``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

GRACE_PERIOD_S = 10.0


def command(address_file: Path) -> list[str]:
    return [sys.executable, "-m", "pipeline.dev.stack.ray_head", "--address-file", str(address_file)]


def wait_address(address_file: Path, exited, timeout_s: float) -> str:
    """The head's Jobs API address once it answers; ``exited()`` true means it died while starting."""
    deadline = time.monotonic() + timeout_s
    while not address_file.exists():
        if exited() or time.monotonic() > deadline:
            raise RuntimeError(f"the Ray head did not start within {timeout_s:.0f}s")
        time.sleep(0.5)
    return json.loads(address_file.read_text())["address"]


def connection(address: str, token: str) -> str:
    """``AIRFLOW_CONN_RAY_DEFAULT`` for the head (what ``pipeline.airflow.connections.ray_connection`` reads)."""
    host, port = address.removeprefix("http://").rsplit(":", 1)
    return json.dumps({"conn_type": "http", "host": host, "port": int(port), "password": token})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.dev.stack.ray_head", description=__doc__)
    parser.add_argument("--address-file", type=Path, required=True, help="written once the head answers")
    args = parser.parse_args(argv)
    from pipeline.job.ray.cluster import LocalCluster

    token = os.environ.pop("RAY_AUTH_TOKEN", "") or None  # the cluster's processes get it from LocalCluster
    # The job's driver runs `python` from the head's PATH: this environment's, with the project installed.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    cluster = LocalCluster(cpus=0, grace_period_s=GRACE_PERIOD_S, token=token, env={"PATH": path})

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        address = cluster.start(lambda line: print(line, flush=True))
        written = args.address_file.with_name(f".{args.address_file.name}.tmp")
        written.write_text(json.dumps({"address": address, "gcs_address": cluster.gcs_address}))
        os.replace(written, args.address_file)  # whole, or not there
        while cluster.proc is not None and cluster.proc.poll() is None:
            time.sleep(1)
        print(f"the Ray head exited; its log ends:\n{cluster.head_log()[-3000:]}", flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
        args.address_file.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
