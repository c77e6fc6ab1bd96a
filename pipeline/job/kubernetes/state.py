"""Reading a training Job's pods: which node each is, why one is not running yet, how one failed, and the one
verdict on an attempt (``verdict``).

Plain functions of the API's objects, shared by the place (the official client) and the triggerer's watch
(its asyncio twin, whose models have the same attributes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.job.kubernetes.manifest import COMPLETION_INDEX
from pipeline.job.policy import Ended

IMAGE_PULL = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "RegistryUnavailable"}
IMAGE_FATAL = {"InvalidImageName", "ErrImageNeverPull"}  # no later pull can succeed
CRASH = {"CrashLoopBackOff", "RunContainerError", "CreateContainerError", "CreateContainerConfigError"}


def node_of(pod: Any) -> int:
    meta = pod.metadata
    for source in (meta.annotations or {}, meta.labels or {}):
        if COMPLETION_INDEX in source:
            return int(source[COMPLETION_INDEX])
    return -1


def by_node(pods: list[Any]) -> dict[int, Any]:
    """The newest pod of each node (an index's pod may be replaced while a deletion is under way)."""
    found: dict[int, Any] = {}
    for pod in pods:
        node = node_of(pod)
        if node not in found or (pod.metadata.creation_timestamp or "") > (found[node].metadata.creation_timestamp or ""):
            found[node] = pod
    return found


def is_started(pod: Any) -> bool:
    """Running, or already ended: its containers ran, so its log can be read."""
    return (pod.status.phase or "") in ("Running", "Succeeded", "Failed") and _container_ran(pod)


def _container_ran(pod: Any) -> bool:
    for status in (pod.status.container_statuses or []):
        if status.state and (status.state.running or status.state.terminated):
            return True
    return (pod.status.phase or "") == "Running"


def waiting_reason(pod: Any) -> tuple[str, bool]:
    """Why a pod is not running: (a line that names the reason, whether it can never get better)."""
    status = pod.status
    for condition in (status.conditions or []):
        if condition.type == "PodScheduled" and condition.status == "False":
            return f"unschedulable: {condition.message or condition.reason}", False
    for container in (status.container_statuses or []) + (status.init_container_statuses or []):
        waiting = container.state.waiting if container.state else None
        if waiting is None:
            continue
        if waiting.reason in IMAGE_PULL:
            return f"image pull failure ({waiting.reason}): {waiting.message or container.image}", waiting.reason in IMAGE_FATAL
        if waiting.reason in CRASH:
            return f"crash loop ({waiting.reason}): {waiting.message or ''}".rstrip(": "), waiting.reason != "CrashLoopBackOff"
        return f"pending ({waiting.reason})", False
    return f"pending ({status.phase or 'not yet scheduled'})", False


def failure(pod: Any) -> str | None:
    """How a failed pod ended (exit code, reason, its termination message), or None while it has not failed."""
    status = pod.status
    if (status.phase or "") != "Failed":
        return None
    for container in status.container_statuses or []:
        ended = container.state.terminated if container.state else None
        if ended is not None:
            message = (ended.message or "").strip()
            return (f"exited with code {ended.exit_code} ({ended.reason or 'Error'})"
                    + (f"; last lines:\n{message}" if message else ""))
    return f"failed ({status.reason or 'unknown'}): {status.message or ''}".rstrip(": ")


def job_condition(job: Any) -> tuple[str, str] | None:
    """("Complete" | "Failed", message) once the Job has ended."""
    for condition in (job.status.conditions or []) if job and job.status else []:
        if condition.type in ("Complete", "Failed", "SuccessCriteriaMet", "FailureTarget") and condition.status == "True":
            kind = "Complete" if condition.type in ("Complete", "SuccessCriteriaMet") else "Failed"
            return kind, f"{condition.reason or ''}: {condition.message or ''}".strip(": ")
    return None


def is_suspended(job: Any) -> bool:
    return bool(job and job.spec and job.spec.suspend)


def schedule_state(job: Any, pods: list[Any], nnodes: int) -> tuple[str, str, bool]:
    """("ready" | "waiting", a line per node that is not running yet, whether waiting cannot help)."""
    if is_suspended(job):
        return "waiting", "the Job is suspended, waiting for Kueue to admit all of its pods", False
    nodes = by_node(pods)
    lines, hopeless = [], False
    for node in range(nnodes):
        pod = nodes.get(node)
        if pod is None:
            lines.append(f"node {node}: no pod yet")
            continue
        failed = failure(pod)
        if failed:
            return "waiting", f"node {node} ({pod.metadata.name}) crashed before every pod was running: {failed}", True
        if is_started(pod):
            continue
        reason, fatal = waiting_reason(pod)
        hopeless |= fatal
        lines.append(f"node {node} ({pod.metadata.name}): {reason}")
    return ("waiting" if lines else "ready"), "; ".join(lines), hopeless


def failed_nodes(pods: list[Any]) -> dict[int, tuple[str, str]]:
    """Node -> (pod name, how it failed) for every failed pod."""
    return {node_of(p): (p.metadata.name, failure(p)) for p in pods if failure(p)}


def failed_what(failed: dict[int, tuple[str, str]], ended: tuple[str, str] | None) -> str:
    """Which node failed and how (the lowest failed node), or the Job's own reason."""
    if failed:
        node, (pod, how) = min(failed.items())
        return f"node {node} (pod {pod}) {how}"
    return f"the Job failed ({ended[1] if ended else 'unknown'})"


@dataclass(frozen=True)
class Verdict:
    """Where an attempt's pods stand: ``running`` once every pod has run (or the Job completed); while not,
    ``detail`` says what each node waits for; ``end`` once the attempt has ended, with ``failed_pods`` (whose
    last log lines go first)."""

    running: bool
    detail: str = ""
    end: Ended | None = None
    failed_pods: tuple[str, ...] = ()


def verdict(job: Any, pods: list[Any], *, name: str, nnodes: int, running: bool, waited_s: float,
            schedule_timeout_s: float) -> Verdict:
    """The attempt's state from its Job and pods: every pod must be running within ``schedule_timeout_s``
    (``waited_s`` so far; ``running``: they were at an earlier look), else it did not start, and says why
    (unschedulable, an image pull failure, a crash); then the first failed pod or the Job's end ends it."""
    ended = job_condition(job)
    if not running and not (ended and ended[0] == "Complete"):
        state, detail, hopeless = schedule_state(job, pods, nnodes)
        if state != "ready":
            if hopeless or (ended and ended[0] == "Failed"):
                return Verdict(False, detail, Ended("not_started", f"Job {name} could not start: {detail or ended[1]}"))
            if waited_s > schedule_timeout_s:
                return Verdict(False, detail, Ended(
                    "not_started", f"the pods of Job {name} were not all running within launch.kubernetes."
                                   f"schedule_timeout_s={schedule_timeout_s:g}s: {detail}"))
            return Verdict(False, detail)
    failed = failed_nodes(pods)
    if failed or (ended and ended[0] == "Failed"):
        return Verdict(True, end=Ended("failed", f"Job {name}: {failed_what(failed, ended)}"),
                       failed_pods=tuple(pod for pod, _ in failed.values()))
    if ended and ended[0] == "Complete":
        return Verdict(True, end=Ended("succeeded", f"Job {name} completed"))
    return Verdict(True)
