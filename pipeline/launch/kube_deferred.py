"""``launch.kubernetes.deferrable``: the Kubernetes launcher's attempt split around Airflow's triggerer.

``start`` (on a worker) creates the attempt's Service and Job and defers to ``TorchrunPodsTrigger``,
which waits on the pods and streams their logs; ``complete`` (on a worker again) deletes the Job,
its pods and the Service whatever the event says, then returns rank 0's result, fails at once on a
rank's user error, replaces the Job while ``launch.max_restarts`` allows, or raises the failure
(retryable). A user stopping the deferred task reaches the trigger's ``on_kill``.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

from pipeline.errors import TrainingFailed, reported_user_error
from pipeline.launch.kube import Cluster, PodsNotRunning, api_client, manifests_for
from pipeline.launch.spec import JobSpec


def start(operator, spec: JobSpec, *, restart: int, started: float) -> None:
    from pipeline.launch.kube_trigger import TorchrunPodsTrigger

    files, kube = spec.files, spec.launch.kubernetes
    files.root.mkdir(parents=True, exist_ok=True)
    if restart == 0:
        files.result.unlink(missing_ok=True)  # never report a previous try's result
    for folder in (files.progress, files.errors):
        shutil.rmtree(folder, ignore_errors=True)
    files.progress.mkdir(parents=True)
    m = manifests_for(spec, restart)
    operator.log.info("creating Job %s/%s: %d pod(s) x %d rank(s), image %s; waiting in the triggerer",
                      m.namespace, m.name, spec.launch.nnodes, spec.launch.nproc_per_node, kube.image)
    cluster = Cluster(api_client(kube.connection_id))
    try:
        cluster.create(m)
    except BaseException:
        cluster.delete(m, int(spec.launch.grace_period_s))  # the Service may exist without its Job
        raise
    operator.defer(
        trigger=TorchrunPodsTrigger(connection_id=kube.connection_id, namespace=m.namespace, name=m.name,
                                    nnodes=spec.launch.nnodes, schedule_timeout_s=kube.schedule_timeout_s,
                                    timeout_s=spec.launch.timeout_s, created_at=time.time()),
        method_name="execute_complete", kwargs={"restart": restart, "started": started},
    )


def complete(operator, spec: JobSpec, event: dict[str, Any], *, restart: int, started: float) -> dict | None:
    from airflow.sdk.exceptions import AirflowFailException

    from pipeline.launch.local import rank_failure

    m = manifests_for(spec, restart)
    cluster = Cluster(api_client(spec.launch.kubernetes.connection_id))
    cluster.delete(m, int(spec.launch.grace_period_s))
    cluster.wait_gone(m)
    operator.log.info("deleted Job %s/%s, its pods and its Service", m.namespace, m.name)
    status, message = event.get("status"), event.get("message", "")
    if status == "complete":
        return spec.files.read_result()
    if status == "not_running":
        raise PodsNotRunning(message)
    user_error = reported_user_error(spec.files.errors)
    if user_error is not None:
        raise AirflowFailException(f"{type(user_error).__name__}: {user_error}") from user_error
    traceback = rank_failure(spec.files.logs(spec.try_number))
    failure = message + (f"\n{traceback}" if traceback else "")
    if status == "failed" and restart < spec.launch.max_restarts:
        operator.log.info("%s; replacing the Job (%d of %d); training resumes from its last checkpoint",
                          message.splitlines()[0], restart + 1, spec.launch.max_restarts)
        start(operator, spec, restart=restart + 1, started=started)
    raise TrainingFailed(failure)
