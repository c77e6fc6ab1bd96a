"""Ray Data as the reader (data.reader = ray) in a real job: Ray Train's two workers fed by several reading tasks
at once on a local Ray cluster, over a published version of the tabular demo."""

from __future__ import annotations

import json
import math
import sys

import pytest

from pipeline import stages
from pipeline.job.ray.cluster import LocalCluster
from pipeline.job.spec import JobSpec
from pipeline.job.supervisor import Job
from pipeline.recipes import tabular_mlp

pytestmark = [pytest.mark.distributed, pytest.mark.ray]


def test_ray_data_feeds_every_worker_an_equal_share_of_every_epoch(demo_parquet, tmp_path):
    cluster = LocalCluster(cpus=2, grace_period_s=5)
    try:
        cluster.start(print)
        cfg = tabular_mlp.config("tiny").with_overrides({
            "data.input_path": str(demo_parquet), "data.reader": "ray", "train.epochs": 2, "train.batch_size": 64,
            "launch.kind": "ray", "launch.nproc_per_node": 2, "launch.ray.address": cluster.address,
            "launch.ray.python": sys.executable, "launch.ray.cpus_per_worker": 0.5})
        dataset = stages.prepare_data(cfg, stages.RunInfo("raydata", "prep"))
        (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
        lines: list[str] = []
        spec = JobSpec(entry=["-m", "pipeline.rank", "--config", str(tmp_path / "config.json"), "--dataset",
                              dataset.uri], job_dir=tmp_path / "job", launch=cfg.launch, name="raydata",
                       labels={"dag_id": "raydata", "run_id": tmp_path.name, "task_id": "train", "try_number": "1"})
        result = Job(spec).run(lines.append)
    finally:
        cluster.stop()
    rows = dataset.rows["train"]
    assert rows > 4 * 1024  # several row ranges: Ray Data reads them in more than one task
    assert any("MapBatches(read_rows)" in line for line in lines)
    # streaming_split(equal=True): each of the 2 workers gets rows // 2 of every epoch, in whole batches
    assert result["world_size"] == 2
    assert result["steps"] == 2 * math.ceil((rows // 2) / 64)
    assert result["metrics"]["val_accuracy"] > 0.55  # it learned (the majority class is 45% of the rows)
