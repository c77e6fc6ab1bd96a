"""What every place guarantees, proven by the same test functions for each place (``launch.kind``).

Places: ``local`` (real torchrun processes, 2 ranks on gloo), ``kubernetes`` against the stand-in API
server of ``tests/kube_standin.py`` (no Kubernetes API server can run on the project's machines: the
launcher and the official client are real, the stand-in plays the scheduler, the Job controller and the
kubelet, and writes into the job folder what the ranks would), and ``kubernetes-deferred``: the same
attempts split around Airflow's triggerer (``pipeline.airflow.deferred`` on the worker's side, the real
``AttemptTrigger`` run to its event as the triggerer runs it); ``ray``: a real Ray cluster on this machine
(one head, started once for the module), each attempt a Ray job whose Ray Train workers run the rank
script, and ``ray-deferred`` the same around the triggerer. Every place's restarts are the supervisor's: each
attempt is a new Ray job there. The places themselves, and the rank script they run, are in
``tests/contract_places.py``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pipeline.errors import (
    RankUserError,
    TrainingFailed,
    TrainingPreempted,
    TrainingStalled,
    TrainingStopped,
    TrainingTimedOut,
)
from tests.contract_places import (
    RANK_ENV,
    DeferredKubernetesPlace,
    DeferredRayContractPlace,
    KubernetesPlace,
    LocalPlace,
    RayContractPlace,
    job_for,
    run,
)

pytestmark = pytest.mark.distributed

PLACES = ["local", "kubernetes", "kubernetes-deferred", pytest.param("ray", marks=pytest.mark.ray),
          pytest.param("ray-deferred", marks=pytest.mark.ray)]


@pytest.fixture(scope="module")
def ray_address():
    from pipeline.job.ray.cluster import LocalCluster

    cluster = LocalCluster(cpus=2, grace_period_s=5)
    cluster.start(print)
    yield cluster.address
    cluster.stop()


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
        kube.POLL_S = kube.KubernetesPlace.poll_s = 0.1
        spec = JobSpec(entry={list(spec.entry)!r}, job_dir=Path({str(spec.job_dir)!r}),
                       launch=launch_config({dataclasses.asdict(spec.launch)!r}),
                       env={spec.env!r}, name={spec.name!r}, labels={spec.labels!r})
        Job(spec, clusters=AirflowClusters()).run(lambda line: print(line, flush=True))
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], env={**os.environ}, stdout=subprocess.PIPE, text=True)
    seen: list[str] = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if place.prefix(1) in line:
                break
        proc.kill()
        proc.wait(10)
    finally:
        proc.kill()
    # The job ran before its supervisor was killed: a driver that never started one would leave nothing too.
    assert any(place.prefix(1) in line for line in seen), "".join(seen[-40:])
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
