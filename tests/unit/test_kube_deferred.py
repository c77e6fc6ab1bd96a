"""The Kubernetes place deferred (``launch.kubernetes.deferrable``): the operator creates the Job on a worker and
defers to ``AttemptTrigger``, run here as Airflow's triggerer runs it, against the stand-in API server
(tests/kube_standin.py, tests/kube_scenarios.py); then the task resumes on the trigger's event. The recipe DAGs'
own train task defers the same way on the run's config."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
from pathlib import Path

import pytest

from pipeline.airflow.trigger import AttemptTrigger
from pipeline.errors import NotStarted as PodsNotRunning
from pipeline.errors import TrainingFailed
from pipeline.job.kubernetes.watch import PodsWatch
from pipeline.job.spec import launch_config
from tests import kube_scenarios
from tests.kube_launch import CONN, assert_torn_down, cluster_for, schedule_clock  # noqa: F401 - a fixture


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


def _first_event(trigger) -> dict:
    """The trigger's first event, as the triggerer takes it (the task resumes on it)."""
    async def first():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(first())


def _runner():
    """Airflow's own triggerer loop (``TriggerRunner.run_trigger``, ``cancel_triggers``)."""
    from airflow.jobs.triggerer_job_runner import TriggerRunner

    return TriggerRunner()


def test_deferred_the_trigger_streams_the_logs_and_the_task_resumes_with_the_result(cluster_for, tmp_path, monkeypatch, capsys):
    cluster = cluster_for(kube_scenarios.nodes_run, lines=3)
    op, context = _operator(tmp_path), _context(tmp_path, monkeypatch)
    trigger, method, kwargs = _defer(op, context)
    assert cluster.created_jobs and method == "execute_complete"
    capsys.readouterr()

    event = _first_event(trigger)
    assert event["status"] == "succeeded"
    logged = capsys.readouterr().out  # the trigger's log: the task log, under the triggerer
    for line in (f"[node {n}] [rank {n}] step {i}" for n in (0, 1) for i in range(3)):
        assert line in logged
    result = getattr(op, method)(context, event=event, **kwargs)
    assert result["final_loss"] == 0.25
    assert_torn_down(cluster)


def test_a_deferred_task_stopped_by_a_user_deletes_the_job_from_the_triggerer(cluster_for, tmp_path, monkeypatch):
    from airflow.jobs import triggerer_job_runner as tjr

    cluster = cluster_for(kube_scenarios.nodes_run, forever=True)
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
        streaming = await asyncio.to_thread(cluster.wait_for, lambda: cluster.max_open_streams >= 2)
        assert streaming, "the trigger never followed both pods' logs"
        runner.to_cancel.append(1)
        await runner.cancel_triggers()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(triggerer(), 60))


def test_deferred_a_failed_pod_is_replaced_within_max_restarts_then_the_task_fails(cluster_for, tmp_path, monkeypatch):
    from airflow.sdk.exceptions import TaskDeferred

    cluster = cluster_for(kube_scenarios.nodes_run, fail_node=1)
    op, context = _operator(tmp_path, max_restarts=1), _context(tmp_path, monkeypatch)
    trigger, method, kwargs = _defer(op, context)

    event = _first_event(trigger)
    assert event["status"] == "failed" and "node 1" in event["message"]
    with pytest.raises(TaskDeferred) as again:  # the replacement Job, deferred in its turn
        getattr(op, method)(context, event=event, **kwargs)
    assert again.value.kwargs["restart"] == 1
    trigger2 = AttemptTrigger(**{**again.value.trigger.serialize()[1], "poll_s": 0.1})
    event2 = _first_event(trigger2)
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

    cluster = cluster_for(kube_scenarios.nodes_run, on_success=rank_0_returns)

    def make():
        return _decorated_operator_class()(
            task_id="fit", python_callable=lambda: None, kind="kubernetes", nnodes=2, nproc_per_node=1,
            grace_period_s=1, kubernetes={"connection_id": CONN, "deferrable": True, "volumes": [f"runs:{tmp_path}"]})

    context = _context(tmp_path, monkeypatch)
    trigger, method, kwargs = _defer(make(), context)

    event = _first_event(trigger)
    assert getattr(make(), method)(context, event=event, **kwargs) == {"loss": 0.5}
    assert_torn_down(cluster)


@pytest.mark.parametrize("scenario, expected", [
    (functools.partial(kube_scenarios.nodes_run, fail_node=1, user_error=True), "DataError: shard 3, row 17"),
    (kube_scenarios.unschedulable, "unschedulable: 0/4 nodes are available"),
], ids=["user-error", "unschedulable"])
def test_deferred_failures_are_classified_as_on_a_worker(cluster_for, tmp_path, monkeypatch, scenario, expected):
    from airflow.sdk.exceptions import AirflowFailException

    cluster = cluster_for(scenario)
    op = _operator(tmp_path, max_restarts=2)
    op.launch = launch_config({**dataclasses.asdict(op.launch), "kubernetes": {
        **dataclasses.asdict(op.launch.kubernetes), "schedule_timeout_s": 1.5}})
    context = _context(tmp_path, monkeypatch)
    trigger, method, kwargs = _defer(op, context)
    monkeypatch.setattr(PodsWatch, "clock", staticmethod(schedule_clock(cluster, origin=trigger.created_at)))

    event = _first_event(trigger)
    error = AirflowFailException if "DataError" in expected else PodsNotRunning
    with pytest.raises(error, match=expected):  # a user error: no retry; pods not running: retryable
        getattr(op, method)(context, event=event, **kwargs)
    assert len(cluster.created_jobs) == 1  # neither is replaced within max_restarts
    assert_torn_down(cluster)


# ----- the recipe DAGs' own train task defers too (TrainOperator, on the run's own config)

RANK_0_RESULT = {"model_files": {"model": "model.pt"}, "metrics": {"val_loss": 0.5, "val_accuracy": 0.75},
                 "world_size": 2, "backend": "gloo", "dataset_version": "v1", "samples_per_s": 1000.0,
                 "steps": 10}


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory) -> str:
    """One MLflow store for the module's train tasks: making its schema takes seconds, each run is new anyway."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _recipe_train(tmp_path, monkeypatch, tracking_uri, **launch):
    """The ``train`` task of the tabular_mlp recipe DAG as the DAG file builds it, and a context whose Params
    put this run on Kubernetes, deferred (what a user types in the trigger form's ``overrides``)."""
    from types import SimpleNamespace

    from pipeline.airflow.dag_factory import recipe_dag
    from pipeline.recipes import get_recipe

    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    task = recipe_dag("tabular_mlp").get_task("train")
    task.prepared = {"name": "tabular_mlp", "uri": str(tmp_path / "data" / "v1"), "version": "v1",
                     "uris": [str(tmp_path / "data" / "v1")], "versions": ["v1"],
                     "rows": {"train": 80, "val": 10, "test": 10}, "interval": None, "skipped": True, "wall_s": 0.1}
    params = {name: schema.get("default") for name, schema in get_recipe("tabular_mlp").airflow_params().items()}
    params["overrides"] = {"launch.kind": "kubernetes", "launch.nnodes": 2, "launch.nproc_per_node": 1,
                           "launch.grace_period_s": 1, **{f"launch.{k}": v for k, v in launch.items()},
                           "launch.kubernetes.connection_id": CONN, "launch.kubernetes.deferrable": True,
                           "launch.kubernetes.volumes": [f"runs:{tmp_path}"]}
    ti = SimpleNamespace(dag_id="tabular_mlp", run_id=f"manual__{tmp_path.name}", task_id="train", map_index=-1,
                         try_number=1)  # a run of its own in the module's MLflow store
    return task, {"ti": ti, "params": params}


def test_a_recipe_dags_train_task_defers_and_returns_the_trained_model(cluster_for, tmp_path, monkeypatch,
                                                                       tracking_uri):
    cluster = cluster_for(kube_scenarios.nodes_run, result=RANK_0_RESULT)
    task, context = _recipe_train(tmp_path, monkeypatch, tracking_uri)
    trigger, method, kwargs = _defer(task, context)
    assert [j["spec"]["completions"] for j in cluster.created_jobs] == [2]  # the run's own launch settings

    event = _first_event(trigger)
    trained = getattr(task, method)(context, event=event, **kwargs)
    assert trained["metrics"] == RANK_0_RESULT["metrics"] and trained["world_size"] == 2
    assert trained["mlflow_run_id"] and trained["mlflow_url"]  # the MLflow run made before the job
    env = cluster.pod_env(cluster.created_jobs[0])
    assert env["MLFLOW_RUN_ID"] == trained["mlflow_run_id"]
    command = cluster.created_jobs[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[-4:-2] == ["--config", env["PIPELINE_JOB_DIR"] + "/config.json"]
    assert_torn_down(cluster)


def test_a_deferred_recipe_train_task_stopped_by_a_user_deletes_the_job(cluster_for, tmp_path, monkeypatch,
                                                                        tracking_uri):
    """Marked failed or success, or cleared while deferred: the scheduler removes the trigger and the
    triggerer calls its on_kill."""
    cluster = cluster_for(kube_scenarios.nodes_run, forever=True)
    task, context = _recipe_train(tmp_path, monkeypatch, tracking_uri)
    trigger, _, _ = _defer(task, context)
    _stop_in_the_triggerer(trigger, cluster)
    assert_torn_down(cluster)


def test_a_deferred_recipe_train_tasks_rank_user_error_fails_without_retries(cluster_for, tmp_path, monkeypatch,
                                                                             tracking_uri):
    from airflow.sdk.exceptions import AirflowFailException

    cluster = cluster_for(kube_scenarios.nodes_run, fail_node=1, user_error=True)
    task, context = _recipe_train(tmp_path, monkeypatch, tracking_uri, max_restarts=2)
    trigger, method, kwargs = _defer(task, context)

    with pytest.raises(AirflowFailException, match="DataError: shard 3, row 17"):
        getattr(task, method)(context, event=_first_event(trigger), **kwargs)
    assert len(cluster.created_jobs) == 1
    assert_torn_down(cluster)
