"""The places the contract tests (tests/integration/test_place_contract.py) run one job on, each behind the same
few methods (``spec``, ``prefix``, ``seen_env``, ``attempts``, ``left_behind``): ``local`` (real torchrun ranks),
``kubernetes`` and ``kubernetes-deferred`` (the stand-in API server, tests/kube_standin.py), ``ray`` and
``ray-deferred`` (Ray jobs on a local cluster); the rank script every place runs, and a deferred task's life
around Airflow's triggerer (``DeferredRun``)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

from pipeline.airflow.connections import AirflowClusters
from pipeline.errors import TrainingStopped
from pipeline.job.kubernetes import place as kube
from pipeline.job.spec import JobSpec, launch_config
from pipeline.job.supervisor import Job
from tests import kube_scenarios
from tests.kube_standin import StandinCluster
from tests.processes import wait_until_gone

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

            progress = Path(os.environ["PIPELINE_PROGRESS_DIR"])
            if rank == 0:
                mark_preempted(progress, rank=0, step=7)
            # As the trainer's barrier does: no rank exits before the marker exists (a rank's exit ends the others).
            deadline = time.monotonic() + 60
            while not (progress / "preempted.json").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
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
        self.cluster = StandinCluster(kube_scenarios.nodes_run).__enter__()
        for key, value in self.cluster.connection_env(CONN).items():
            monkeypatch.setenv(key, value)

    def close(self) -> None:
        self.cluster.__exit__()

    def spec(self, mode: str, **launch) -> JobSpec:
        self.cluster.scenario = functools.partial(kube_scenarios.nodes_run, **KUBE_SCENARIOS[mode])
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
        """Ray jobs submitted: Ray Train restarts no worker within one."""
        return sum(line.startswith("submitting Ray job") for line in self.lines)

    def left_behind(self) -> list:
        from tests.ray_cluster import train_actors_left

        return train_actors_left(self.address)


class DeferredRayContractPlace(RayContractPlace):
    deferred = True


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
