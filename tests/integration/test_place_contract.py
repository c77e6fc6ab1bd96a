"""What every place guarantees, proven by the same test functions for each place (``launch.kind``).

Places: ``local`` (real torchrun processes, 2 ranks on gloo), ``kubernetes`` against the stand-in API
server of ``tests/kube_standin.py`` (no Kubernetes API server can run on the project's machines: the
launcher and the official client are real, the stand-in plays the scheduler, the Job controller and the
kubelet, and writes into the job folder what the ranks would), and ``kubernetes-deferred``: the same
attempts split around Airflow's triggerer (``pipeline.airflow.deferred`` on the worker's side, the real
``AttemptTrigger`` run to its event as the triggerer runs it); ``ray``: a real Ray cluster on this machine
(one head, started once for the module), each attempt a Ray job whose Ray Train workers run the rank
script, and ``ray-deferred`` the same around the triggerer. Ray Train restarts failed workers itself, within
the attempt: there ``attempts`` counts the worker groups Ray started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pipeline.airflow.connections import AirflowClusters
from pipeline.errors import (
    RankUserError,
    TrainingFailed,
    TrainingPreempted,
    TrainingStalled,
    TrainingStopped,
    TrainingTimedOut,
)
from pipeline.job.kubernetes import place as kube
from pipeline.job.spec import JobSpec, launch_config
from pipeline.job.supervisor import Job
from tests import kube_standin
from tests.kube_standin import StandinCluster
from tests.processes import wait_until_gone

pytestmark = pytest.mark.distributed

PLACES = ["local", "kubernetes", "kubernetes-deferred", pytest.param("ray", marks=pytest.mark.ray),
          pytest.param("ray-deferred", marks=pytest.mark.ray)]
CONN = "k8s_contract"
# What every place exports to every rank (pipeline.job.spec.Attempt.env).
RANK_ENV = ("PIPELINE_JOB_DIR", "PIPELINE_CHECKPOINT_DIR", "PIPELINE_RESULT_FILE", "PIPELINE_PROGRESS_DIR",
            "PIPELINE_ERROR_DIR", "PIPELINE_TRY_NUMBER", "PIPELINE_RESTART_COUNT", "PIPELINE_BACKEND", "CONTRACT_VAR")

RANK = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        rank, mode = int(os.environ["RANK"]), sys.argv[1]
        restart = int(os.environ["PIPELINE_RESTART_COUNT"])
        for step in range(3):
            print(f"[rank {rank}] step {step}", flush=True)
        if mode == "fail" and rank == 1:
            raise ValueError("boom from rank 1")
        if mode == "user_error" and rank == 1:
            from pipeline.errors import DataError
            from pipeline.job_files import user_errors_reported

            with user_errors_reported():
                raise DataError("shard 3, row 17: label 'x' is not a class")
        if mode == "stall":
            from pipeline.job_files import Heartbeat

            Heartbeat.from_env().beat(5, total=100, force=True)
            time.sleep(600)
        if mode == "forever":
            time.sleep(600)
        if mode == "preempt" and restart == 0:
            from pipeline.job_files import PREEMPTED_EXIT_CODE, mark_preempted

            if rank == 0:
                mark_preempted(Path(os.environ["PIPELINE_PROGRESS_DIR"]), rank=0, step=7)
            sys.exit(PREEMPTED_EXIT_CODE)
        if rank == 0:
            result = {"restart": restart, "env": {k: os.environ.get(k) for k in %r}}
            Path(os.environ["PIPELINE_RESULT_FILE"]).write_text(json.dumps(result))

    if __name__ == "__main__":
        main()
    """ % (RANK_ENV,)
)

KUBE_SCENARIOS = {
    "ok": {}, "fail": {"fail_node": 1}, "user_error": {"fail_node": 1, "user_error": True},
    "stall": {"forever": True, "stalled": True}, "forever": {"forever": True}, "preempt": {"preempt_first": True},
}


class LocalPlace:
    """Real torchrun ranks running ``contract_rank.py`` in the given mode."""

    deferred = False

    def __init__(self, tmp_path: Path, monkeypatch):
        self.tmp_path, self.marker = tmp_path, f"contract-{os.getpid()}-{tmp_path.name}"
        (tmp_path / "contract_rank.py").write_text(RANK)

    def spec(self, mode: str, **launch) -> JobSpec:
        options = {"kind": "local", "nproc_per_node": 2, "grace_period_s": 1, **launch}
        return JobSpec(entry=["-m", "contract_rank", mode, self.marker], job_dir=self.tmp_path / "job",
                       launch=launch_config(options), env={"PYTHONPATH": str(self.tmp_path), "CONTRACT_VAR": "1"},
                       name="contract")

    def prefix(self, rank: int) -> str:
        return f"{rank}]:[rank {rank}]"  # torchrun's --tee prefix, then the rank's own line

    def seen_env(self, result: dict) -> dict:
        return result["env"]

    def attempts(self) -> int:
        return sum(line.startswith("launching: ") for line in self.lines)

    def left_behind(self) -> list:
        return wait_until_gone(self.marker, timeout_s=15)


class KubernetesPlace:
    """The stand-in API server playing each mode's cluster."""

    deferred = False

    def __init__(self, tmp_path: Path, monkeypatch):
        self.tmp_path = tmp_path
        monkeypatch.setattr(kube, "POLL_S", 0.1)
        monkeypatch.setattr(kube.KubernetesPlace, "poll_s", 0.1)
        self.cluster = StandinCluster(kube_standin.nodes_run).__enter__()
        for key, value in self.cluster.connection_env(CONN).items():
            monkeypatch.setenv(key, value)

    def close(self) -> None:
        self.cluster.__exit__()

    def spec(self, mode: str, **launch) -> JobSpec:
        self.cluster.scenario = functools.partial(kube_standin.nodes_run, **KUBE_SCENARIOS[mode])
        options = {"kind": "kubernetes", "nnodes": 2, "nproc_per_node": 1, "grace_period_s": 1, **launch,
                   "kubernetes": {"connection_id": CONN, "volumes": [f"runs:{self.tmp_path}"], "schedule_timeout_s": 20,
                                  "deferrable": self.deferred}}
        return JobSpec(entry=["-m", "contract_rank", mode], job_dir=self.tmp_path / "job", launch=launch_config(options),
                       env={"CONTRACT_VAR": "1"}, name="contract",
                       labels={"dag_id": "dag", "run_id": "manual__1", "task_id": "train", "try_number": "1"})

    def prefix(self, rank: int) -> str:
        return f"[node {rank}] [rank {rank}]"

    def seen_env(self, result: dict) -> dict:
        return self.cluster.pod_env(self.cluster.created_jobs[-1])

    def attempts(self) -> int:
        return len(self.cluster.created_jobs)

    def left_behind(self) -> list:
        self.cluster.wait_for(lambda: not self.cluster.left_behind(), 10)
        return self.cluster.left_behind()


class DeferredKubernetesPlace(KubernetesPlace):
    deferred = True


class RayContractPlace:
    """A Ray job on the module's cluster; its Ray Train workers run ``contract_rank.py``."""

    deferred = False

    def __init__(self, tmp_path: Path, monkeypatch, address: str):
        self.tmp_path, self.address = tmp_path, address
        (tmp_path / "contract_rank.py").write_text(RANK)

    def spec(self, mode: str, **launch) -> JobSpec:
        options = {"kind": "ray", "nproc_per_node": 2, "grace_period_s": 1, **launch,
                   "ray": {"address": self.address, "python": sys.executable, "cpus_per_worker": 0.5,
                           "deferrable": self.deferred}}
        return JobSpec(entry=["-m", "contract_rank", mode], job_dir=self.tmp_path / "job", launch=launch_config(options),
                       env={"PYTHONPATH": str(self.tmp_path), "CONTRACT_VAR": "1"}, name="contract",
                       labels={"dag_id": "dag", "run_id": self.tmp_path.name, "task_id": "train", "try_number": "1"})

    def prefix(self, rank: int) -> str:
        return f"[rank {rank}]: [rank {rank}]"  # the worker's prefix, then the rank's own line

    def seen_env(self, result: dict) -> dict:
        return result["env"]

    def attempts(self) -> int:
        """Jobs submitted, and the restarts of their workers that Ray Train announced."""
        return sum(line.startswith("submitting Ray job") or "restarting every rank" in line for line in self.lines)

    def left_behind(self) -> list:
        from tests.ray_cluster import train_actors_left

        return train_actors_left(self.address)


class DeferredRayContractPlace(RayContractPlace):
    deferred = True


@pytest.fixture(scope="module")
def ray_address():
    from pipeline.job.ray.cluster import LocalCluster

    cluster = LocalCluster(cpus=2, grace_period_s=5)
    cluster.start(print)
    yield cluster.address
    cluster.stop()


class _Operator:
    """What the deferred form needs of an operator: its log and ``defer``."""

    def __init__(self, emit):
        self.log = _logger("contract.operator", emit)

    def defer(self, *, trigger, method_name, kwargs):
        from airflow.sdk.exceptions import TaskDeferred

        raise TaskDeferred(trigger=trigger, method_name=method_name, kwargs=kwargs)


class _ListHandler(logging.Handler):
    def __init__(self, emit):
        super().__init__()
        self.emit_line = emit

    def emit(self, record):
        self.emit_line(record.getMessage())


def _logger(name: str, emit) -> logging.Logger:
    """A logger whose lines go to ``emit``: the task log of the operator and of the trigger."""
    log = logging.getLogger(name)
    log.setLevel(logging.INFO)
    log.handlers = [_ListHandler(emit)]
    log.propagate = False
    return log


class DeferredRun:
    """A deferred task's life: start on a worker, the trigger to its event in a triggerer loop, complete on a
    worker; again while attempts are replaced. ``stop`` is a user marking the task failed: the triggerer
    cancels the trigger and calls its ``on_kill``."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self._stop = threading.Event()

    def run(self, emit):
        from airflow.sdk.exceptions import TaskDeferred

        from pipeline.airflow import deferred
        from pipeline.airflow.trigger import AttemptTrigger

        operator = _Operator(emit)
        try:
            deferred.start(operator, self.spec, restart=0, started=time.time())
        except TaskDeferred as exc:
            pending = exc
        while True:
            classpath, kwargs = pending.trigger.serialize()  # what the triggerer stores and rebuilds it from
            assert classpath == "pipeline.airflow.trigger.AttemptTrigger"
            trigger = AttemptTrigger(**{**kwargs, "poll_s": 0.1})
            trigger._log = _logger("contract.trigger", emit)  # the trigger's lines reach the task log
            event = asyncio.run(self._triggerer(trigger))
            try:
                return deferred.complete(operator, self.spec, event, **pending.kwargs)
            except TaskDeferred as exc:
                pending = exc

    async def _triggerer(self, trigger):
        from airflow.jobs.triggerer_job_runner import TriggerRunner

        async def first_event():
            async for event in trigger.run():
                return event.payload

        runner = TriggerRunner()
        task = asyncio.create_task(first_event())
        runner.triggers[1] = {"task": task, "name": "train", "events": 0}
        while not task.done():
            if self._stop.is_set():
                await trigger.on_kill()  # what the triggerer calls for a user's stop (_USER_ACTION_CANCEL_MSG)
                task.cancel()
                raise TrainingStopped("the deferred task was stopped by a user")
            await asyncio.sleep(0.1)
        return task.result()

    def stop(self):
        self._stop.set()


# The deferred form differs from the worker's only in where it waits (the same policy code, and the deferred
# Kubernetes place proves every function around the triggerer): for Ray, what its watch adds is proven, the
# job's lines and result through the triggerer and a user's stop of the deferred task.
RAY_DEFERRED = {"test_a_job_streams_every_ranks_lines_live_and_returns_rank_0s_result",
                "test_a_stop_from_outside_tears_everything_down"}


@pytest.fixture(params=PLACES)
def place(request, tmp_path, monkeypatch):
    if request.param == "ray-deferred" and request.node.originalname not in RAY_DEFERRED:
        pytest.skip("the Ray place proves this; deferred, only where it waits differs (RAY_DEFERRED)")
    if request.param.startswith("ray"):
        kind = {"ray": RayContractPlace, "ray-deferred": DeferredRayContractPlace}[request.param]
        made = kind(tmp_path, monkeypatch, request.getfixturevalue("ray_address"))
    else:
        kind = {"local": LocalPlace, "kubernetes": KubernetesPlace, "kubernetes-deferred": DeferredKubernetesPlace}
        made = kind[request.param](tmp_path, monkeypatch)
    yield made
    if hasattr(made, "close"):
        made.close()


def job_for(place, spec: JobSpec):
    return DeferredRun(spec) if place.deferred else Job(spec, clusters=AirflowClusters())


def run(place, mode: str, **launch):
    lines: list[str] = []
    place.lines = lines
    spec = place.spec(mode, **launch)
    try:
        return job_for(place, spec).run(lines.append), lines, spec
    except Exception as exc:
        exc.lines = lines  # type: ignore[attr-defined]
        raise


def test_a_job_streams_every_ranks_lines_live_and_returns_rank_0s_result(place):
    result, lines, _ = run(place, "ok")
    assert result["restart"] == 0
    for rank in (0, 1):
        assert any(place.prefix(rank) in line and line.endswith("step 2") for line in lines), (rank, lines)
    assert place.left_behind() == []


def test_every_place_gives_the_ranks_the_same_environment(place):
    result, _, spec = run(place, "ok")
    env = place.seen_env(result)
    files = spec.files
    assert {key: env[key] for key in RANK_ENV} == {
        "PIPELINE_JOB_DIR": str(files.root), "PIPELINE_CHECKPOINT_DIR": str(files.checkpoints),
        "PIPELINE_RESULT_FILE": str(files.result), "PIPELINE_PROGRESS_DIR": str(files.progress),
        "PIPELINE_ERROR_DIR": str(files.errors), "PIPELINE_TRY_NUMBER": "1", "PIPELINE_RESTART_COUNT": "0",
        "PIPELINE_BACKEND": "auto", "CONTRACT_VAR": "1"}


def test_a_rank_user_error_fails_at_once_without_a_restart(place):
    with pytest.raises(RankUserError, match="rank 1: DataError: shard 3, row 17"):
        run(place, "user_error", max_restarts=2)
    assert place.attempts() == 1
    assert place.left_behind() == []


def test_an_infrastructure_failure_is_restarted_then_fails_as_retryable(place):
    with pytest.raises(TrainingFailed) as err:
        run(place, "fail", max_restarts=1)
    assert type(err.value) is TrainingFailed  # retryable by Airflow, not a user error
    assert place.attempts() == 2
    assert any("restarting every rank (1 of 1)" in line for line in err.value.lines)
    assert "boom" in str(err.value)  # the failing rank's own words
    assert place.left_behind() == []


def test_a_preempted_attempt_is_restarted_and_the_next_one_finishes(place):
    result, lines, _ = run(place, "preempt", max_restarts=1)
    assert result["restart"] == 1 and place.attempts() == 2
    assert any("checkpointed at step 7" in line and "restarting every rank" in line for line in lines)
    assert place.left_behind() == []


def test_a_preemption_without_restarts_left_is_retryable(place):
    with pytest.raises(TrainingPreempted, match="checkpointed at step 7"):
        run(place, "preempt", max_restarts=0)
    assert place.left_behind() == []


def test_a_stall_stops_the_job_without_a_restart(place):
    with pytest.raises(TrainingStalled, match=r"no step completed .* rank \d: step 5/100"):
        run(place, "stall", stall_timeout_s=2, max_restarts=2)
    assert place.attempts() == 1  # the task retry decides
    assert place.left_behind() == []


def test_the_run_timeout_stops_the_job_without_a_restart(place):
    with pytest.raises(TrainingTimedOut, match=r"launch.timeout_s=4s"):
        run(place, "forever", timeout_s=4, max_restarts=2)
    assert place.attempts() == 1
    assert place.left_behind() == []


def test_a_stop_from_outside_tears_everything_down(place):
    """on_kill on a worker (the task cleared, marked failed, timed out), or a user's stop of a deferred task."""
    spec = place.spec("forever")
    job = job_for(place, spec)
    outcome: list[BaseException] = []
    lines: list[str] = []

    def target():
        try:
            job.run(lines.append)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + 60
    while not any(place.prefix(1) in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(place.prefix(1) in line for line in lines), lines
    job.stop()
    thread.join(60)
    assert isinstance(outcome[0], TrainingStopped)
    assert place.left_behind() == []


def test_a_killed_task_process_leaves_nothing_running(place, tmp_path):
    """SIGKILL of the process running the supervisor (a killed worker): the place's guard ends the job.
    A deferred task holds no process while it waits: its stop is the triggerer's (the test above)."""
    if place.deferred:
        pytest.skip("a deferred task has no process of its own while it waits")
    spec = place.spec("forever")
    driver = textwrap.dedent(f"""
        from pathlib import Path
        from pipeline.airflow.connections import AirflowClusters
from pipeline.job.kubernetes import place as kube
        from pipeline.job.spec import JobSpec, launch_config
        from pipeline.job.supervisor import Job
        from pipeline.airflow.connections import AirflowClusters
        kube.POLL_S = kube.KubernetesPlace.poll_s = 0.1
        spec = JobSpec(entry={list(spec.entry)!r}, job_dir=Path({str(spec.job_dir)!r}),
                       launch=launch_config({dataclasses.asdict(spec.launch)!r}),
                       env={spec.env!r}, name={spec.name!r}, labels={spec.labels!r})
        Job(spec, clusters=AirflowClusters()).run(lambda line: print(line, flush=True))
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], env={**os.environ}, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if place.prefix(1) in line:
                break
        proc.kill()
        proc.wait(10)
    finally:
        proc.kill()
    assert place.left_behind() == []


@pytest.mark.ray
def test_a_ray_job_left_under_the_attempts_id_is_stopped_and_replaced(ray_address, tmp_path, monkeypatch):
    """A worker that died left its attempt's Ray job running: the attempt run again stops it and submits its
    own under the same id, once Ray's job monitor and supervisor actor are done with the old one (a new job
    under that id before then is failed by the old job's monitor)."""
    from pipeline.job.ray.cluster import jobs_client
    from pipeline.job.ray.place import job_request
    from pipeline.job.spec import Attempt

    place = RayContractPlace(tmp_path, monkeypatch, ray_address)
    client = jobs_client(ray_address)
    sid = client.submit_job(**{**job_request(Attempt(place.spec("ok"), 0), local=False), "entrypoint": "sleep 600"})
    deadline = time.monotonic() + 60
    while str(client.get_job_status(sid).value) != "RUNNING":
        assert time.monotonic() < deadline, client.get_job_info(sid)
        time.sleep(0.2)
    result, lines, _ = run(place, "ok")
    assert result["restart"] == 0
    assert any(line.startswith(f"Ray job {sid} exists already (RUNNING") for line in lines), lines
    assert str(client.get_job_status(sid).value) == "SUCCEEDED"
    assert place.left_behind() == []
