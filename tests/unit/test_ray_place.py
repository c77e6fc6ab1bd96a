"""What the Ray place submits, without a cluster: the job's identity across tries and restarts, and what its
runtime_env may carry; and how it takes a job's log from the Jobs API's two calls (a stand-in client here:
tests/integration/test_place_contract.py streams real jobs' logs)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shlex

import pytest

from pipeline.job.ray.place import JobLog, job_request, run_name
from pipeline.job.spec import Attempt, JobSpec, launch_config


def _spec(run_id: str = "scheduled__2026-12-01", try_number: int = 1, **env) -> JobSpec:
    return JobSpec(entry=["-m", "pipeline.rank", "--config", "/runs/x/train/config.json"], job_dir=f"/runs/{run_id}/train",
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
    assert argv[argv.index("--") + 1:] == ["-m", "pipeline.rank", "--config", "/runs/x/train/config.json"]


def test_the_worker_group_start_timeout_reaches_ray_trains_controller():
    request = job_request(Attempt(_spec(), 0), local=False)
    assert request["runtime_env"]["env_vars"]["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "60"  # Ray's own default
    spec = dataclasses.replace(_spec(), launch=launch_config(
        {"kind": "ray", "ray": {"address": "http://ray-head:8265", "worker_start_timeout_s": 12.5}}))
    assert job_request(Attempt(spec, 0), local=False)["runtime_env"]["env_vars"][
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "12.5"


def test_ray_train_restarts_nothing_and_each_restart_is_the_supervisors_new_job(tmp_path):
    """One restart count per run: Ray Train is left no restart to make (a worker group that could not start is
    tried again, elastic sizes still apply), and a failed Ray attempt is restarted from above, as a new job that
    tells its ranks which restart it is."""
    from pipeline.job import attempts
    from pipeline.job.policy import Ended
    from pipeline.job.ray.entry import trainer

    spec = dataclasses.replace(_spec(), job_dir=tmp_path, launch=launch_config(
        {"kind": "ray", "nnodes": 2, "min_nnodes": 1, "nproc_per_node": 2, "max_restarts": 2,
         "ray": {"address": "http://ray-head:8265"}}))
    job = json.loads(shlex.split(job_request(Attempt(spec, 0), local=False)["entrypoint"])[4])
    built = trainer(job, ["-m", "pipeline.rank"])
    failures = built.run_config.failure_config
    assert (failures.max_failures, failures.max_preemption_failures, failures.controller_failure_limit) == (0, 0, 2)
    assert built.scaling_config.num_workers == (2, 4)
    requests = [job_request(Attempt(spec, restart), local=False) for restart in (0, 1)]
    assert [r["runtime_env"]["env_vars"]["PIPELINE_RESTART_COUNT"] for r in requests] == ["0", "1"]
    assert requests[0]["submission_id"] != requests[1]["submission_id"]
    decision = attempts.verdict(Attempt(spec, 0), Ended("failed", "Ray job x failed: a worker died"))
    assert decision.action == "restart" and decision.max_restarts == 2


class _JobsAPI:
    """A job's log through the Jobs API's two calls: the websocket's chunks (then held open, as the Jobs API
    holds it a second or two after the job's end; or closed; or broken) and the whole log, which by then has
    lines the stream has not brought."""

    def __init__(self, chunks: list[str], rest: str, *, stream: str = "open"):
        self.chunks, self.rest, self.stream = chunks, rest, stream
        self.whole_reads = 0
        self.sent = asyncio.Event()

    async def tail_job_logs(self, sid: str):
        for chunk in self.chunks:
            yield chunk
        self.sent.set()
        if self.stream == "broken":
            raise RuntimeError("connection lost")
        if self.stream == "open":  # the job runs on: its stream stays open until cancelled
            await asyncio.Event().wait()

    def get_job_logs(self, sid: str) -> str:
        self.whole_reads += 1
        return "".join(self.chunks) + self.rest


def _follow_then_finish(jobs: _JobsAPI) -> list[str]:
    lines: list[str] = []

    async def run():
        log = JobLog(jobs, "job-1", lines.append)
        following = asyncio.create_task(log.follow())
        await jobs.sent.wait()
        await asyncio.sleep(0)  # the stream's end, where it has one, is taken first
        await asyncio.to_thread(log.finish)
        await asyncio.to_thread(log.finish)  # a second finish (the place's stop after its poll) adds nothing
        following.cancel()

    asyncio.run(run())
    return lines


CHUNKS = ["(RayTrainWorker) [rank 0]: step 0\n[rank 1]: st", "ep 0\n\x1b[32m[rank 0]: step 1\x1b[0m\n"]


def test_a_jobs_last_lines_come_from_the_whole_log_without_waiting_for_the_stream_to_close():
    jobs = _JobsAPI(CHUNKS, "[rank 1]: step 1\nfit() returned\n")
    assert _follow_then_finish(jobs) == ["(RayTrainWorker) [rank 0]: step 0", "[rank 1]: step 0", "[rank 0]: step 1",
                                         "[rank 1]: step 1", "fit() returned"]  # each once, in order, uncoloured
    assert jobs.whole_reads == 1


def test_a_stream_that_closed_at_the_jobs_end_brought_every_line():
    jobs = _JobsAPI([*CHUNKS, "last words, no newline"], "", stream="closed")
    assert _follow_then_finish(jobs)[-2:] == ["[rank 0]: step 1", "last words, no newline"]
    assert jobs.whole_reads == 0


@pytest.mark.parametrize("rest", ["[rank 1]: step 1\n", ""])
def test_a_broken_stream_is_said_and_the_whole_log_completes_it(rest):
    jobs = _JobsAPI(CHUNKS, rest, stream="broken")
    lines = _follow_then_finish(jobs)
    assert lines[3] == "(the Ray job's log stream ended: RuntimeError: connection lost)"
    assert lines[:3] + lines[4:] == ["(RayTrainWorker) [rank 0]: step 0", "[rank 1]: step 0", "[rank 0]: step 1",
                                     *rest.splitlines()]
