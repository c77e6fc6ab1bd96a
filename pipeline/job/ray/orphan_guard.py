"""Stops a Ray job when the task process that submitted it dies unannounced (``pipeline.job.orphan_guard``).

The request: the cluster's address, its token and the job's submission id; an orphaned guard calls
``stop_job`` and waits until Ray says the job has ended. (A local cluster needs no such guard: it runs
under ``pipeline.job.local.process_group`` and dies with the task process.)
"""

from __future__ import annotations

import sys

from pipeline.job.orphan_guard import orphaned_request


def main() -> int:
    request = orphaned_request()
    if request is None:
        return 0
    from pipeline.job.ray.cluster import jobs_client
    from pipeline.job.ray.place import STOP_TIMEOUT_S, stop_job

    print(f"ray_guard: the task process ended without stopping Ray job {request['submission_id']}: stopping it",
          file=sys.stderr, flush=True)
    stop_job(jobs_client(request["address"], request.get("token")), request["submission_id"], STOP_TIMEOUT_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
