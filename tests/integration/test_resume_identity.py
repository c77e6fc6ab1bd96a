"""A retry of the train task resumes from the last try's checkpoints when only how or where the work runs changed
(another input path of the same bytes, preparation workers and batch rows, logging, registry, gate, ranks), and
starts over, saying why, when a field that changes the trained model did or the rows are another dataset version.
Real torchrun ranks, a real MLflow."""

from __future__ import annotations

import shutil

import pytest

from pipeline import stages
from pipeline.job.supervisor import Job
from pipeline.recipes import tabular_mlp
from pipeline.stages.run import RunInfo

pytestmark = pytest.mark.distributed


def test_a_retry_resumes_across_where_changes_and_starts_over_on_a_what_change(demo_parquet, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    first_cfg = tabular_mlp.config("tiny").with_overrides({"data.input_path": str(demo_parquet), "train.epochs": 1})

    def attempt(cfg, try_number: int):
        run = RunInfo("identity", "manual__1", try_number=try_number)
        dataset = stages.prepare_data(cfg, run)
        lines: list[str] = []
        result = Job(stages.train_job(cfg, run, dataset), metrics_flush_timeout_s=5).run(lines.append)
        return dataset, result, lines

    dataset, first, _ = attempt(first_cfg, 1)
    assert first["resumed_from"] is None and first["steps"] > 0

    (tmp_path / "moved").mkdir()
    same_bytes = shutil.copy(demo_parquet, tmp_path / "moved" / demo_parquet.name)  # a file's name keys its splits
    elsewhere = first_cfg.with_overrides({
        "data.input_path": str(same_bytes), "data.workers": 1, "data.batch_rows": 500, "train.log_every_steps": 1,
        "registry.experiment": "identity-elsewhere", "evaluate.min_improvement": 0.5, "launch.nproc_per_node": 1})
    moved, resumed, _ = attempt(elsewhere, 2)
    assert moved.version == dataset.version
    assert resumed["resumed_from"] is not None and resumed["start_step"] == first["steps"]

    faster = elsewhere.with_overrides({"train.learning_rate": elsewhere.train.learning_rate * 2})
    _, restarted, lines = attempt(faster, 3)
    assert restarted["resumed_from"] is None and restarted["start_step"] == 0
    said = [line for line in lines if "not resuming" in line]
    assert said and first_cfg.digest() in said[0] and faster.digest() in said[0], lines

    # The same settings over other rows (another file, so another dataset version) start over too.
    from pipeline.data import demo

    other_rows = demo.write_parquet(tmp_path / "other" / demo_parquet.name, 6_000, seed=2)
    newer, again, lines = attempt(faster.with_overrides({"data.input_path": str(other_rows)}), 4)
    assert newer.version != moved.version
    assert again["resumed_from"] is None and again["start_step"] == 0
    said = [line for line in lines if "not resuming" in line]
    assert said and moved.version in said[0] and newer.version in said[0], lines
