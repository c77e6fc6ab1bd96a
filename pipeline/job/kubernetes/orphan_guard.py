"""Deletes a training Job and its Service when the task process that created them dies unannounced.

The request (``pipeline.job.orphan_guard``): API server settings, namespace and name; an orphaned guard deletes
the Job (foreground: its pods first) and the Service.
"""

from __future__ import annotations

import os
import sys
import tempfile

from pipeline.job.orphan_guard import orphaned_request


def client_from(settings: dict):
    from kubernetes import client as k8s

    conf = k8s.Configuration()
    conf.host = settings["host"]
    conf.api_key = settings.get("api_key") or {}
    conf.api_key_prefix = settings.get("api_key_prefix") or {}
    conf.verify_ssl = settings.get("verify_ssl", True)
    token_file = settings.get("token_file")
    if token_file and os.path.exists(token_file) and "BearerToken" in conf.api_key:
        with open(token_file) as fh:
            conf.api_key["BearerToken"] = "Bearer " + fh.read().strip()
    for name in ("ssl_ca_cert", "cert_file", "key_file"):
        if settings.get(name):
            fd, path = tempfile.mkstemp(prefix="kube-guard-")
            with os.fdopen(fd, "w") as fh:
                fh.write(settings[name])
            setattr(conf, name, path)
    return k8s.ApiClient(conf)


def main() -> int:
    request = orphaned_request()
    if request is None:
        return 0
    from pipeline.job.kubernetes.manifest import Manifests
    from pipeline.job.kubernetes.place import Cluster

    manifests = Manifests.named(request["namespace"], request["name"])
    cluster = Cluster(client_from(request["client"]))
    print(f"kube_guard: the task process ended without tearing down Job {request['namespace']}/{request['name']}: "
          f"deleting it and its Service", file=sys.stderr, flush=True)
    cluster.delete(manifests)
    cluster.wait_gone(manifests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
