"""What only the Kubernetes place does, against a stand-in API server (tests/kube_standin.py): no
Kubernetes API server can run on the project's machines. The place is the real one, with the official
client reaching the server through the Kubernetes provider's connection; the stand-in plays the
scheduler, the Job controller and the kubelet. What every place guarantees is in test_place_contract.py."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from pathlib import Path

import pytest

from pipeline.airflow.connections import AirflowClusters
from pipeline.airflow.trigger import AttemptTrigger
from pipeline.errors import NotStarted as PodsNotRunning
from pipeline.errors import RankUserError, TrainingFailed
from pipeline.job.kubernetes import place as kube
from pipeline.job.spec import Attempt, JobSpec, launch_config
from pipeline.job.supervisor import Job as _Job
from tests import kube_standin
from tests.kube_standin import StandinCluster


def Job(spec: JobSpec) -> _Job:  # noqa: N802 - the supervisor's Job, reaching the stand-in through the connection
    return _Job(spec, clusters=AirflowClusters())

CONN = "k8s_standin"
# Exactly the verbs the README's Role grants.
ROLE = {("create", "jobs"), ("get", "jobs"), ("delete", "jobs"), ("create", "services"), ("delete", "services"),
        ("list", "pods"), ("get", "pods/log")}


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(kube, "POLL_S", 0.1)


def make_spec(tmp_path: Path, *, try_number: int = 1, **launch) -> JobSpec:
    kubernetes = {"connection_id": CONN, "volumes": [f"runs:{tmp_path}"], "schedule_timeout_s": 20,
                  **launch.pop("kubernetes", {})}
    options = {"kind": "kubernetes", "nnodes": 2, "nproc_per_node": 8, "grace_period_s": 1,
               "kubernetes": kubernetes, **launch}
    return JobSpec(entry=["-m", "pipeline.rank", "--recipe", "tabular_mlp"], job_dir=tmp_path / "job",
                   launch=launch_config(options), name=f"dag-train-{try_number}", try_number=try_number,
                   labels={"dag_id": "dag", "run_id": "manual__2026-11-30T12:00:00+00:00", "task_id": "train",
                           "try_number": str(try_number)})


@pytest.fixture
def cluster_for(monkeypatch):
    started = []

    def start(scenario, **kwargs) -> StandinCluster:
        cluster = StandinCluster(functools.partial(scenario, **kwargs) if kwargs else scenario).__enter__()
        for key, value in cluster.connection_env(CONN).items():
            monkeypatch.setenv(key, value)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.__exit__()


def assert_torn_down(cluster: StandinCluster) -> None:
    assert cluster.wait_for(lambda: not cluster.left_behind(), 10), cluster.left_behind()
    jobs = [d for d in cluster.deletions if d["kind"] == "jobs"]
    assert jobs and all(d["propagationPolicy"] == "Foreground" for d in jobs)
    assert {d["name"] for d in cluster.deletions if d["kind"] == "services"} >= {d["name"] for d in jobs}
    assert set(cluster.requests) <= ROLE, set(cluster.requests) - ROLE


def test_a_job_runs_streams_every_pods_log_live_and_returns_rank_0s_result(cluster_for, tmp_path):
    cluster = cluster_for(kube_standin.nodes_run, lines=4)
    lines: list[str] = []
    result = Job(make_spec(tmp_path)).run(lines.append)
    assert result == {"final_loss": 0.25, "nodes": 2, "restart": 0}  # written by "rank 0" into the shared job folder
    for node in (0, 1):
        assert [line for line in lines if line.startswith(f"[node {node}] ")] == [
            f"[node {node}] [rank {node}] step {i}" for i in range(4)]
    assert cluster.max_open_streams == 2  # both pods' logs were followed at the same time
    created = cluster.created_jobs[0]["metadata"]
    assert created["labels"]["pipeline.ddp/run_id"] == "manual__2026-11-30T12_00_00_00_00"
    assert created["annotations"]["pipeline.ddp/run_id"] == "manual__2026-11-30T12:00:00+00:00"
    assert any(line.startswith("all 2 pod(s)") for line in lines)
    assert_torn_down(cluster)


def test_unschedulable_pods_fail_the_attempt_with_the_schedulers_message(cluster_for, tmp_path):
    cluster = cluster_for(kube_standin.unschedulable)
    with pytest.raises(PodsNotRunning) as err:
        Job(make_spec(tmp_path, kubernetes={"schedule_timeout_s": 1.5})).run(lambda line: None)
    message = str(err.value)
    assert "schedule_timeout_s=1.5s" in message
    assert "node 1" in message and "unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu." in message
    assert_torn_down(cluster)


def test_an_image_pull_failure_is_named_when_the_schedule_timeout_passes(cluster_for, tmp_path):
    cluster = cluster_for(kube_standin.image_pull_backoff)
    with pytest.raises(PodsNotRunning, match=r'node 1 \(.*\): image pull failure \(ImagePullBackOff\): '
                                             r'Back-off pulling image "registry.example/ddp:missing"'):
        Job(make_spec(tmp_path, kubernetes={"schedule_timeout_s": 1.5, "image": "registry.example/ddp:missing"})).run(print)
    assert_torn_down(cluster)


def test_a_pod_that_crashes_before_the_others_run_fails_at_once(cluster_for, tmp_path):
    cluster = cluster_for(kube_standin.crash_before_start)
    started = time.monotonic()
    with pytest.raises(PodsNotRunning, match=r"node 1 .* crashed before every pod was running: exited with code 127"):
        Job(make_spec(tmp_path, kubernetes={"schedule_timeout_s": 600})).run(print)
    assert time.monotonic() - started < 60  # not the schedule timeout
    assert_torn_down(cluster)


def test_a_failed_pod_stops_the_job_and_max_restarts_replaces_it_then_the_attempt_fails(cluster_for, tmp_path):
    cluster = cluster_for(kube_standin.nodes_run, fail_node=1)
    lines: list[str] = []
    with pytest.raises(TrainingFailed) as err:
        Job(make_spec(tmp_path, max_restarts=1)).run(lines.append)
    assert not isinstance(err.value, RankUserError)
    assert "node 1 (pod " in str(err.value) and "exited with code 1" in str(err.value)
    names = [j["metadata"]["name"] for j in cluster.created_jobs]
    assert len(names) == 2 and names[0].endswith("-r0") and names[1].endswith("-r1")
    assert any("restarting every rank (1 of 1)" in line for line in lines)
    assert "[node 1] RuntimeError: boom" in lines  # the failing pod's last lines reached the task log
    assert_torn_down(cluster)


def test_a_pod_removed_after_it_succeeded_does_not_fail_the_task(cluster_for, tmp_path):
    """The autoscaler may delete a finished pod before its log is read: the Job's own status decides."""
    cluster = cluster_for(kube_standin.nodes_run, lines=3, autoscaled_away=True)
    lines: list[str] = []
    assert Job(make_spec(tmp_path)).run(lines.append)["nodes"] == 2
    assert any(line.startswith("[node 1] (log stream of") and "(404)" in line for line in lines), lines
    assert "[node 0] [rank 0] step 2" in lines
    assert_torn_down(cluster)


def test_a_job_left_by_a_dead_worker_of_the_same_attempt_is_replaced(cluster_for, tmp_path):
    from kubernetes import client as k8s

    from pipeline.job.kubernetes.place import Cluster, manifests_for  # noqa: F401

    cluster = cluster_for(kube_standin.nodes_run)
    spec = make_spec(tmp_path)
    leftover = manifests_for(Attempt(spec, 0))
    Cluster(AirflowClusters().kubernetes_client(CONN)).create(leftover)  # its pods run: the scenario plays them
    assert Job(spec).run(lambda line: None)["nodes"] == 2
    assert [j["metadata"]["name"] for j in cluster.created_jobs] == [leftover.name] * 2
    assert cluster.deletions[0]["name"] == leftover.name  # the leftover went first
    assert isinstance(leftover.job, k8s.V1Job)
    assert_torn_down(cluster)


def test_an_airflow_retry_gets_a_new_job_over_the_same_checkpoint_folder(cluster_for, tmp_path):
    cluster = cluster_for(kube_standin.nodes_run, fail_node=0)
    with pytest.raises(TrainingFailed):
        Job(make_spec(tmp_path, try_number=1)).run(lambda line: None)
    cluster.scenario = functools.partial(kube_standin.nodes_run, result={"resumed": True})
    assert Job(make_spec(tmp_path, try_number=2)).run(lambda line: None) == {"resumed": True}
    first, second = cluster.created_jobs
    assert first["metadata"]["name"] != second["metadata"]["name"]
    assert second["metadata"]["labels"]["pipeline.ddp/try_number"] == "2"
    envs = [cluster.pod_env(j) for j in (first, second)]
    assert envs[0]["PIPELINE_CHECKPOINT_DIR"] == envs[1]["PIPELINE_CHECKPOINT_DIR"] == str(tmp_path / "job" / "checkpoints")
    assert [e["PIPELINE_TRY_NUMBER"] for e in envs] == ["1", "2"]
    assert_torn_down(cluster)


# ----- deferrable: the operator defers to the trigger, which runs as Airflow's triggerer runs it


def _operator(tmp_path, **launch):
    from pipeline.airflow import TorchrunOperator

    return TorchrunOperator(task_id="fit", entry=["-m", "pipeline.rank"], kind="kubernetes", nnodes=2,
                            nproc_per_node=1, grace_period_s=1, **launch,
                            kubernetes={"connection_id": CONN, "deferrable": True, "volumes": [f"runs:{tmp_path}"]})


def _context(tmp_path, monkeypatch, try_number=1):
    from types import SimpleNamespace

    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    ti = SimpleNamespace(dag_id="dag", run_id=f"deferred-{os.getpid()}", task_id="fit", map_index=-1, try_number=try_number)
    return {"ti": ti}


def _defer(op, context):
    from airflow.sdk.exceptions import TaskDeferred

    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    trigger = deferred.value.trigger
    classpath, kwargs = trigger.serialize()  # what the triggerer stores and rebuilds it from
    assert classpath == "pipeline.airflow.trigger.AttemptTrigger"
    rebuilt = AttemptTrigger(**{**kwargs, "poll_s": 0.1})
    return rebuilt, deferred.value.method_name, deferred.value.kwargs


def _runner():
    """Airflow's own triggerer loop (``TriggerRunner.run_trigger``, ``cancel_triggers``)."""
    from airflow.jobs.triggerer_job_runner import TriggerRunner

    return TriggerRunner()


def test_deferred_the_trigger_streams_the_logs_and_the_task_resumes_with_the_result(cluster_for, tmp_path, monkeypatch, capsys):
    cluster = cluster_for(kube_standin.nodes_run, lines=3)
    op, context = _operator(tmp_path), _context(tmp_path, monkeypatch)
    trigger, method, kwargs = _defer(op, context)
    assert cluster.created_jobs and method == "execute_complete"
    capsys.readouterr()

    async def first_event():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    assert event["status"] == "succeeded"
    logged = capsys.readouterr().out  # the trigger's log: the task log, under the triggerer
    for line in (f"[node {n}] [rank {n}] step {i}" for n in (0, 1) for i in range(3)):
        assert line in logged
    result = getattr(op, method)(context, event=event, **kwargs)
    assert result["final_loss"] == 0.25
    assert_torn_down(cluster)


def test_a_deferred_task_stopped_by_a_user_deletes_the_job_from_the_triggerer(cluster_for, tmp_path, monkeypatch):
    from airflow.jobs import triggerer_job_runner as tjr

    cluster = cluster_for(kube_standin.nodes_run, forever=True)
    trigger, _, _ = _defer(_operator(tmp_path), _context(tmp_path, monkeypatch))
    _stop_in_the_triggerer(trigger, cluster)
    assert tjr._USER_ACTION_CANCEL_MSG  # the path that calls the trigger's on_kill
    assert_torn_down(cluster)


def _stop_in_the_triggerer(trigger, cluster) -> None:
    """Run ``trigger`` in Airflow's own triggerer loop until both pods stream, then stop it as a user's
    'mark failed' or 'clear' does: the scheduler removes the trigger, and the triggerer calls its on_kill."""
    runner = _runner()

    async def triggerer():
        runner.triggers[1] = {"task": None, "name": "train", "events": 0}
        task = asyncio.create_task(runner.run_trigger(1, trigger))
        runner.triggers[1]["task"] = task
        while cluster.max_open_streams < 2:
            await asyncio.sleep(0.1)
        runner.to_cancel.append(1)
        await runner.cancel_triggers()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(triggerer(), 60))


def test_deferred_a_failed_pod_is_replaced_within_max_restarts_then_the_task_fails(cluster_for, tmp_path, monkeypatch):
    from airflow.sdk.exceptions import TaskDeferred

    cluster = cluster_for(kube_standin.nodes_run, fail_node=1)
    op, context = _operator(tmp_path, max_restarts=1), _context(tmp_path, monkeypatch)
    trigger, method, kwargs = _defer(op, context)

    async def first_event(t):
        async for event in t.run():
            return event.payload

    event = asyncio.run(first_event(trigger))
    assert event["status"] == "failed" and "node 1" in event["message"]
    with pytest.raises(TaskDeferred) as again:  # the replacement Job, deferred in its turn
        getattr(op, method)(context, event=event, **kwargs)
    assert again.value.kwargs["restart"] == 1
    trigger2 = AttemptTrigger(**{**again.value.trigger.serialize()[1], "poll_s": 0.1})
    event2 = asyncio.run(first_event(trigger2))
    with pytest.raises(TrainingFailed, match="node 1"):
        getattr(op, method)(context, event=event2, **again.value.kwargs)
    assert [j["metadata"]["name"][-3:] for j in cluster.created_jobs] == ["-r0", "-r1"]
    assert_torn_down(cluster)


def test_deferred_task_torchrun_returns_rank_0s_return_value(cluster_for, tmp_path, monkeypatch):
    """``@task.torchrun`` resumes in a fresh operator: it finds the function's return value in the job folder."""
    import cloudpickle

    from pipeline.airflow.operator import _decorated_operator_class

    def rank_0_returns(job):  # what pipeline.train.function does in rank 0 of the pods
        command = job["spec"]["template"]["spec"]["containers"][0]["command"]
        assert command[-4:-2] == ["-m", "pipeline.train.function"]
        Path(command[-1]).write_bytes(cloudpickle.dumps({"loss": 0.5}))

    cluster = cluster_for(kube_standin.nodes_run, on_success=rank_0_returns)

    def make():
        return _decorated_operator_class()(
            task_id="fit", python_callable=lambda: None, kind="kubernetes", nnodes=2, nproc_per_node=1,
            grace_period_s=1, kubernetes={"connection_id": CONN, "deferrable": True, "volumes": [f"runs:{tmp_path}"]})

    context = _context(tmp_path, monkeypatch)
    trigger, method, kwargs = _defer(make(), context)

    async def first_event():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    assert getattr(make(), method)(context, event=event, **kwargs) == {"loss": 0.5}
    assert_torn_down(cluster)


@pytest.mark.parametrize("scenario, expected", [
    (functools.partial(kube_standin.nodes_run, fail_node=1, user_error=True), "DataError: shard 3, row 17"),
    (kube_standin.unschedulable, "unschedulable: 0/4 nodes are available"),
], ids=["user-error", "unschedulable"])
def test_deferred_failures_are_classified_as_on_a_worker(cluster_for, tmp_path, monkeypatch, scenario, expected):
    from airflow.sdk.exceptions import AirflowFailException

    cluster = cluster_for(scenario)
    op = _operator(tmp_path, max_restarts=2)
    op.launch = launch_config({**dataclasses.asdict(op.launch), "kubernetes": {
        **dataclasses.asdict(op.launch.kubernetes), "schedule_timeout_s": 1.5}})
    context = _context(tmp_path, monkeypatch)
    trigger, method, kwargs = _defer(op, context)

    async def first_event():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    error = AirflowFailException if "DataError" in expected else PodsNotRunning
    with pytest.raises(error, match=expected):  # a user error: no retry; pods not running: retryable
        getattr(op, method)(context, event=event, **kwargs)
    assert len(cluster.created_jobs) == 1  # neither is replaced within max_restarts
    assert_torn_down(cluster)


# ----- the recipe DAGs' own train task defers too (TrainOperator, on the run's own config)

RANK_0_RESULT = {"model_files": {"model": "model.pt"}, "metrics": {"val_loss": 0.5, "val_accuracy": 0.75},
                 "world_size": 2, "backend": "gloo", "dataset_version": "v1", "samples_per_s": 1000.0,
                 "steps": 10}


def _recipe_train(tmp_path, monkeypatch, **launch):
    """The ``train`` task of the tabular_mlp recipe DAG as the DAG file builds it, and a context whose Params
    put this run on Kubernetes, deferred (what a user types in the trigger form's ``overrides``)."""
    from types import SimpleNamespace

    from pipeline.airflow.dag_factory import recipe_dag
    from pipeline.recipes import get_recipe

    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    task = recipe_dag("tabular_mlp").get_task("train")
    task.prepared = {"name": "tabular_mlp", "uri": str(tmp_path / "data" / "v1"), "version": "v1",
                     "uris": [str(tmp_path / "data" / "v1")], "versions": ["v1"],
                     "rows": {"train": 80, "val": 10, "test": 10}, "interval": None, "skipped": True, "wall_s": 0.1}
    params = {name: schema.get("default") for name, schema in get_recipe("tabular_mlp").airflow_params().items()}
    params["overrides"] = {"launch.kind": "kubernetes", "launch.nnodes": 2, "launch.nproc_per_node": 1,
                           "launch.grace_period_s": 1, **{f"launch.{k}": v for k, v in launch.items()},
                           "launch.kubernetes.connection_id": CONN, "launch.kubernetes.deferrable": True,
                           "launch.kubernetes.volumes": [f"runs:{tmp_path}"]}
    ti = SimpleNamespace(dag_id="tabular_mlp", run_id=f"manual__{os.getpid()}", task_id="train", map_index=-1,
                         try_number=1)
    return task, {"ti": ti, "params": params}


def test_a_recipe_dags_train_task_defers_and_returns_the_trained_model(cluster_for, tmp_path, monkeypatch):
    cluster = cluster_for(kube_standin.nodes_run, result=RANK_0_RESULT)
    task, context = _recipe_train(tmp_path, monkeypatch)
    trigger, method, kwargs = _defer(task, context)
    assert [j["spec"]["completions"] for j in cluster.created_jobs] == [2]  # the run's own launch settings

    async def first_event():
        async for event in trigger.run():
            return event.payload

    event = asyncio.run(first_event())
    trained = getattr(task, method)(context, event=event, **kwargs)
    assert trained["metrics"] == RANK_0_RESULT["metrics"] and trained["world_size"] == 2
    assert trained["mlflow_run_id"] and trained["mlflow_url"]  # the MLflow run made before the job
    env = cluster.pod_env(cluster.created_jobs[0])
    assert env["MLFLOW_RUN_ID"] == trained["mlflow_run_id"]
    command = cluster.created_jobs[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-4:-2] == ["--config", env["PIPELINE_JOB_DIR"] + "/config.json"]
    assert_torn_down(cluster)


def test_a_deferred_recipe_train_task_stopped_by_a_user_deletes_the_job(cluster_for, tmp_path, monkeypatch):
    """Marked failed or success, or cleared while deferred: the scheduler removes the trigger and the
    triggerer calls its on_kill."""
    cluster = cluster_for(kube_standin.nodes_run, forever=True)
    task, context = _recipe_train(tmp_path, monkeypatch)
    trigger, _, _ = _defer(task, context)
    _stop_in_the_triggerer(trigger, cluster)
    assert_torn_down(cluster)


def test_a_deferred_recipe_train_tasks_rank_user_error_fails_without_retries(cluster_for, tmp_path, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    cluster = cluster_for(kube_standin.nodes_run, fail_node=1, user_error=True)
    task, context = _recipe_train(tmp_path, monkeypatch, max_restarts=2)
    trigger, method, kwargs = _defer(task, context)

    async def first_event():
        async for event in trigger.run():
            return event.payload

    with pytest.raises(AirflowFailException, match="DataError: shard 3, row 17"):
        getattr(task, method)(context, event=asyncio.run(first_event()), **kwargs)
    assert len(cluster.created_jobs) == 1
    assert_torn_down(cluster)
