"""Every writer of the job folder meets a full disk the way checkpoints do (tests/integration/test_out_of_space.py):
one ``OutOfSpace`` naming the file, what it needed and what is free, a user error (the task fails at once, no
retry), no temporary file left. The supervisor's telemetry, rank 0's metrics, the heartbeats and the preemption
marker, the attempts' record and the copies pulled from the job's store (an S3 API server), each on a real full
file system (a 2 MiB tmpfs); then a real supervised job whose telemetry lands on that disk mid-training."""

from __future__ import annotations

import re
import time

import psutil
import pytest

from pipeline.diskspace import free_bytes
from pipeline.errors import OutOfSpace, UserError
from pipeline.job import cost
from pipeline.job.mirror import JobStore
from pipeline.job.telemetry import RankTelemetry
from pipeline.job_files import Heartbeat, JobFiles, MetricsSink, mark_preempted


def _fill(disk) -> None:
    """Every free byte of ``disk`` taken."""
    (disk / "filler").write_bytes(bytes(free_bytes(disk)))
    assert free_bytes(disk) == 0


def _no_space_for(path) -> str:
    return rf"{re.escape(str(path))}: the write failed: no space left on the device .* it needed [\d,]+ bytes, 0 bytes"


def _leftovers(disk) -> list[str]:
    """Temporary files, and lines written in part (an append that did not fit leaves its file empty)."""
    return sorted(str(p.relative_to(disk)) for p in disk.rglob("*") if p.is_file() and p.name != "filler"
                  and (p.name.startswith(".") or p.stat().st_size))


def test_each_writer_of_the_job_folder_on_a_full_disk_is_out_of_space(small_disk, s3, tmp_path):
    files = JobFiles(small_disk / "job")
    files.progress.mkdir(parents=True)
    _fill(small_disk)

    telemetry = RankTelemetry(files.telemetry, ratio=1.5, windows=2)
    beats = {rank: {"host": "node-0", "windows": [{"step": 10, "compute_s": 0.01, "step_time_s": 0.02}]}
             for rank in range(2)}
    with pytest.raises(OutOfSpace, match=_no_space_for(files.telemetry)) as raised:
        telemetry.update(beats)
    assert isinstance(raised.value, UserError) and "it is not retried" in str(raised.value)

    with pytest.raises(OutOfSpace, match=_no_space_for(files.metrics)):
        MetricsSink(files.metrics).log({"loss": 0.5}, step=1)
    with pytest.raises(OutOfSpace, match=_no_space_for(files.progress / "rank-0.json")):
        Heartbeat(files.progress, 0)  # its first beat, "starting"
    with pytest.raises(OutOfSpace, match=_no_space_for(files.progress / "preempted.json")):
        mark_preempted(files.progress, rank=0, step=7)

    from pipeline.config import LaunchConfig

    with pytest.raises(OutOfSpace, match=_no_space_for(files.attempts)):
        cost.record(files.attempts, LaunchConfig(), started=time.time() - 5, ended=time.time(), ranks=2,
                    status="failed")

    # The store's copy of a node's files (nodes that share no folder), pulled into the full job folder.
    node = JobFiles(tmp_path / "node")
    Heartbeat(node.progress, 1).beat(3, force=True)
    store = JobStore(f"{s3}/jobs/one")
    store.push(node, 0)
    with pytest.raises(OutOfSpace, match=_no_space_for(files.progress / "rank-1.json")):
        store.pull(files, now=True)

    assert _leftovers(small_disk) == []  # no temporary and no half-written file


@pytest.mark.distributed
def test_a_job_whose_telemetry_meets_a_full_disk_fails_as_a_user_error_with_its_checkpoints_intact(
        small_disk, demo_parquet, tmp_path, monkeypatch):
    from pipeline import stages
    from pipeline.job.supervisor import Job
    from pipeline.recipes import tabular_mlp
    from pipeline.stages.run import RunInfo
    from pipeline.train.checkpoint import CheckpointStore

    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    # The job folder on the usual disk, its telemetry file on the small one, which fills once training has begun.
    telemetry = small_disk / "telemetry.jsonl"
    monkeypatch.setattr(JobFiles, "telemetry", property(lambda files: telemetry))
    cfg = tabular_mlp.config("tiny").with_overrides({
        "data.input_path": str(demo_parquet), "train.epochs": 3, "train.log_every_steps": 1,
        "train.checkpoint_every_steps": 5})
    run = RunInfo("full_disk", "manual__1")
    spec = stages.train_job(cfg, run, stages.prepare_data(cfg, run))
    store = CheckpointStore(spec.files.checkpoints)

    def emit(line: str) -> None:
        if "checkpoint step" in line and telemetry.exists() and not (small_disk / "filler").exists():
            _fill(small_disk)

    with pytest.raises(OutOfSpace, match=_no_space_for(telemetry)) as raised:
        Job(spec, metrics_flush_timeout_s=5).run(emit)
    assert isinstance(raised.value, UserError)
    assert (small_disk / "filler").exists()  # it failed on the full disk, not before
    assert store.load_latest() is not None  # what was checkpointed stays loadable
    ranks = [p for p in psutil.Process().children(recursive=True) if "pipeline.rank" in " ".join(p.cmdline())]
    assert ranks == []  # no rank outlives the failed task
