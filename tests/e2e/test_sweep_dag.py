"""A sweep through a real Airflow deployment: `tabular_mlp_sweep` triggered over the REST API (what the Params form
does), scheduler (LocalExecutor) and api-server on PostgreSQL, the study on a PostgreSQL database of its own (the
services deployment's layout), an `mlflow server`, and real torchrun ranks for every trial.

A search space with an unknown field or an impossible bound is refused when triggered. Then 4 trials of 2 ranks,
2 at a time in a `gpu` pool of 4 slots: the lr=1e-5 trial is pruned, slot 0's ranks are killed
after its first checkpoint (no restarts: the Airflow retry resumes it), the best trial is registered and promoted.
Then the run is cleared: every trial is reused, nothing trains or registers again.
"""

from __future__ import annotations

from datetime import datetime

import pytest

from pipeline.stages.run import RunInfo
from tests.faults import sigkill_rank, when_checkpoint
from tests.services import MlflowServer, PostgresDatabase, airflow_deployment, dag_parsed, wait_for

pytestmark = pytest.mark.e2e

DAG_ID = "tabular_mlp_sweep"
BAD_LR = 1e-5


@pytest.fixture()
def deployment(tmp_path, monkeypatch):
    from pipeline import deployment

    studies, tracking = PostgresDatabase(), PostgresDatabase()
    server = MlflowServer(tracking.url, tmp_path / "mlflow-artifacts", workers=2)
    try:
        server.start()
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
        monkeypatch.setenv("PIPELINE_DATA_DIR", str(tmp_path / "data"))
        monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
        monkeypatch.delenv("PIPELINE_TRAIN_POOL_SLOTS", raising=False)
        dags = tmp_path / "dags"
        dags.mkdir()
        (dags / "sweeps.py").symlink_to(deployment.PROJECT_ROOT / "dags" / "sweeps.py")
        env = {"PIPELINE_TRAIN_POOL": "gpu", "PIPELINE_RETRY_DELAY_S": "1", "AIRFLOW__CORE__PARALLELISM": "4",
               "PIPELINE_SWEEP_DB": studies.url.replace("postgresql://", "postgresql+psycopg2://", 1)}
        with airflow_deployment(tmp_path, dags, monkeypatch, env) as api:
            yield api
    finally:
        server.stop()
        tracking.close()
        studies.close()


def test_a_sweep_refuses_bad_spaces_prunes_retries_releases_the_best_and_reuses_its_trials_when_cleared(
        deployment, demo_parquet):
    import optuna
    from optuna.trial import TrialState

    from pipeline.registry import models
    from pipeline.registry.tracking import RUN_KEY_TAG, client
    from pipeline.sweep.study import storage

    api = deployment
    api.request("POST", "/api/v2/pools", {"name": "gpu", "slots": 4})
    wait_for(lambda: dag_parsed(api, DAG_ID), "the dag-processor to parse the sweep DAG", timeout_s=240)
    # A search space naming an unknown field or a bound the field refuses: the API answers 400, no run exists.
    for space, named in (({"train.learnig_rate": {"low": 1e-4, "high": 1e-2}}, "learnig_rate"),
                         ({"train.learning_rate": {"low": 1e-4, "high": 2.0}}, "2.0")):  # above its maximum, 1.0
        with pytest.raises(OSError) as refused:  # urllib's HTTPError
            api.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": {"search_space": space}})
        assert refused.value.code == 400 and named in refused.value.read().decode()
    assert api.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns")["total_entries"] == 0
    model = "tabular_mlp_sweep_e2e"
    conf = {"variant": "tiny", "input_path": str(demo_parquet), "epochs": 8, "max_restarts": 0, "model_name": model,
            "overrides": {"registry.experiment": model, "train.checkpoint_every_steps": 10},
            "n_trials": 4, "prune_after_trials": 1, "prune_after_epochs": 0,
            "search_space": {"train.learning_rate": {"low": BAD_LR, "high": 3e-2, "log": True}},
            # Equal good points first (none is pruned against another), the bad one last: with 2 at a time and the
            # killed slot's place taken by the third, the fourth is asked only once a trial has finished.
            "enqueue": [{"train.learning_rate": 0.01}, {"train.learning_rate": 0.01},
                        {"train.learning_rate": 0.01}, {"train.learning_rate": BAD_LR}]}
    run_id = api.request("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})["dag_run_id"]
    run = RunInfo(DAG_ID, run_id)

    # Slot 0's ranks killed after its first checkpoint: with no restarts the attempt fails, the task is retried.
    killed: dict = {}
    when_checkpoint(run.job_dir("train", 0), sigkill_rank(0, killed), min_step=10, timeout_s=600)
    assert _wait_for_run(api, run_id) == "success", _states(api, run_id)

    trials = _trials(api, run_id)
    assert [t["state"] for t in trials] == ["success"] * 4
    assert killed and trials[0]["try_number"] == 2  # killed once, retried once
    # Every try of every trial: never more than the pool's 4 slots (2 trials of 2 ranks) at once, and 2 did run
    # side by side.
    tries = [t for slot in range(4) for t in _tries(api, run_id, slot)]
    assert len(tries) == 5 and {t["pool_slots"] for t in tries} == {2}
    assert max(_overlap(tries, "pool_slots")) <= 4 and max(_overlap(tries, None)) == 2
    # The retry resumed from the checkpoint the killed try left (its rank 0 says so in the job's logs).
    logs = "".join(p.read_text(errors="replace") for p in (run.job_dir("train", 0) / "logs-try2").rglob("*.log"))
    assert "resuming from checkpoint" in logs

    study = optuna.load_study(study_name=run.key, storage=storage())
    by_slot = {t.user_attrs["slot"]: t for t in study.get_trials() if "slot" in t.user_attrs}
    assert sorted(by_slot) == [0, 1, 2, 3] and len(study.trials) == 4  # the retried slot kept its trial
    bad = next(t for t in by_slot.values() if t.params["train.learning_rate"] == BAD_LR)
    assert bad.state == TrialState.PRUNED and len(bad.intermediate_values) < 8
    assert by_slot[0].state in (TrialState.COMPLETE, TrialState.PRUNED)

    # MLflow: a parent run for the sweep, a child per trial with its state; the best one's model released.
    mlflow = client()
    runs = mlflow.search_runs([mlflow.get_experiment_by_name(model).experiment_id])
    parent = next(r for r in runs if r.data.tags.get("sweep") == "parent")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 4
    states = {r.data.tags["sweep.trial"]: (r.data.tags["sweep.trial_state"], r.info.status) for r in children}
    assert states[str(bad.number)] == ("pruned", "KILLED")
    assert all(state == ("complete", "FINISHED") for number, state in states.items()
               if study.trials[int(number)].state == TrialState.COMPLETE)
    best = study.best_trial
    assert parent.data.tags["sweep.best_trial"] == str(best.number) and parent.info.status == "FINISHED"
    assert parent.data.metrics["best_val_loss"] == pytest.approx(best.value)
    assert parent.data.metrics["trials_pruned"] >= 1
    best_run = parent.data.tags["sweep.best_run_id"]
    versions = mlflow.search_model_versions(f"name = '{model}'")
    assert [(v.run_id, v.tags[RUN_KEY_TAG]) for v in versions] == [(best_run, run.key)]
    assert str(models.version_by_alias(model, "champion").version) == versions[0].version
    curve = mlflow.get_metric_history(best_run, "val_loss")
    assert len(curve) == 8  # the best trial's per-epoch curve in its child run

    # Cleared: the same study, every trial reused (no attempt trains again), nothing registered twice.
    attempts = {slot: (run.job_dir("train", slot) / "attempts.jsonl").read_text() for slot in range(4)}
    api.request("POST", f"/api/v2/dags/{DAG_ID}/clearTaskInstances",
                {"dry_run": False, "dag_run_id": run_id, "only_failed": False, "reset_dag_runs": True})
    wait_for(lambda: _run_state(api, run_id) != "success", "the cleared run to start again", timeout_s=60)
    assert _wait_for_run(api, run_id) == "success", _states(api, run_id)
    assert {t["try_number"] for t in _trials(api, run_id)} >= {2, 3}
    assert {slot: (run.job_dir("train", slot) / "attempts.jsonl").read_text() for slot in range(4)} == attempts
    assert len(optuna.load_study(study_name=run.key, storage=storage()).trials) == 4
    assert len(mlflow.search_model_versions(f"name = '{model}'")) == 1


def _run_state(api, run_id: str) -> str | None:
    try:
        return api.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")["state"]
    except OSError:
        return None  # the api-server too busy to answer on a loaded machine


def _wait_for_run(api, run_id: str) -> str:
    return wait_for(lambda: (s := _run_state(api, run_id)) in ("success", "failed") and s, "the sweep run to end",
                    timeout_s=900, poll_s=2)


def _trials(api, run_id: str) -> list[dict]:
    found = api.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/train/listMapped")
    return sorted(found["task_instances"], key=lambda t: t["map_index"])


def _tries(api, run_id: str, map_index: int) -> list[dict]:
    path = f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/train/{map_index}/tries"
    return api.request("GET", path)["task_instances"]


def _states(api, run_id: str) -> dict:
    found = api.request("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances")["task_instances"]
    return {(t["task_id"], t["map_index"]): (t["state"], t["try_number"]) for t in found}


def _overlap(instances: list[dict], weight: str | None) -> list[int]:
    """At each start, what the running instances hold (their pool slots, or 1 each): from their start and end times."""
    spans = [(datetime.fromisoformat(t["start_date"]), datetime.fromisoformat(t["end_date"]), t[weight] if weight else 1)
             for t in instances]
    return [sum(w for s, e, w in spans if s <= start < e) for start, _, _ in spans]
