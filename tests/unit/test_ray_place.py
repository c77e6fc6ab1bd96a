"""What the Ray place submits, without a cluster: the job's identity across tries and restarts, and what its
runtime_env may carry."""

from __future__ import annotations

import dataclasses
import json
import shlex

from pipeline.job.ray.place import job_request, run_name
from pipeline.job.spec import JobSpec, launch_config
from pipeline.job.supervisor import Attempt


def _spec(run_id: str = "scheduled__2026-12-01", try_number: int = 1, **env) -> JobSpec:
    return JobSpec(entry=["-m", "pipeline.train", "--config", "/runs/x/train/config.json"], job_dir=f"/runs/{run_id}/train",
                   launch=launch_config({"kind": "ray", "ray": {"address": "http://ray-head:8265"}}),
                   name=f"image_classifier-train-{try_number}", try_number=try_number,
                   env={"MLFLOW_RUN_ID": "abc", "MLFLOW_TRACKING_URI": "http://mlflow:5000", **env},
                   labels={"dag_id": "image_classifier", "run_id": run_id, "task_id": "train",
                           "try_number": str(try_number)})


def test_a_retry_or_a_restart_is_a_new_submission_of_the_same_ray_train_run():
    first, retry, other_run = _spec(), _spec(try_number=2), _spec(run_id="scheduled__2026-12-02")
    ids = {job_request(Attempt(s, r), local=False)["submission_id"] for s in (first, retry, other_run) for r in (0, 1)}
    assert len(ids) == 6  # a reused submission id is refused by the Jobs API: never one twice
    assert run_name(first) == run_name(retry) != run_name(other_run)  # a retry finds the same run


def test_secrets_never_travel_in_the_jobs_runtime_env_or_metadata():
    request = job_request(Attempt(_spec(MLFLOW_TRACKING_PASSWORD="hunter2", AWS_SECRET_ACCESS_KEY="s3cr3t",
                                        MLFLOW_TRACKING_TOKEN="tok", HF_TOKEN="hf", API_KEY="k"), 0), local=False)
    text = json.dumps(request)
    assert not any(secret in text for secret in ("hunter2", "s3cr3t", '"tok"', '"hf"', '"k"'))
    env = request["runtime_env"]["env_vars"]
    assert env["MLFLOW_RUN_ID"] == "abc" and env["PIPELINE_JOB_DIR"] == "/runs/scheduled__2026-12-01/train"
    assert env["RAY_DEDUP_LOGS"] == "0"
    argv = shlex.split(request["entrypoint"])
    assert argv[:3] == ["python", "-m", "pipeline.job.ray.entry"]  # a remote cluster's own interpreter
    assert argv[argv.index("--") + 1:] == ["-m", "pipeline.train", "--config", "/runs/x/train/config.json"]


def test_the_worker_group_start_timeout_reaches_ray_trains_controller():
    request = job_request(Attempt(_spec(), 0), local=False)
    assert request["runtime_env"]["env_vars"]["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "60"  # Ray's own default
    spec = dataclasses.replace(_spec(), launch=launch_config(
        {"kind": "ray", "ray": {"address": "http://ray-head:8265", "worker_start_timeout_s": 12.5}}))
    assert job_request(Attempt(spec, 0), local=False)["runtime_env"]["env_vars"][
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "12.5"
