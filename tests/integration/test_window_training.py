"""A window of daily dataset versions through the real stages: torchrun ranks train on all of them as
one StreamingDataset, the registered model carries the window's vocabularies, and evaluation scores
the test splits of every day in the window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import deployment, stages
from pipeline.data import demo
from pipeline.recipes import tabular_mlp
from tests import jobs

pytestmark = pytest.mark.distributed

DAYS = ["2026-11-24", "2026-11-25", "2026-11-26", "2026-11-27"]


def test_training_registration_and_evaluation_read_the_whole_window(pipeline_home):
    root = pipeline_home / "inputs" / "window-days"
    demo.write_partitions(root, DAYS, 700, seed=3)
    cfg = tabular_mlp.config("tiny").with_overrides({
        "data.input_path": str(root), "data.window_intervals": 3, "train.epochs": 2,
        "registry.model_name": "window_mlp", "registry.experiment": "window_mlp",
    })
    daily = []
    for day, end in zip(DAYS, DAYS[1:] + ["2026-11-28"]):
        run = stages.RunInfo("daily", f"scheduled__{day}", data_interval_start=f"{day}T00:00:00+00:00",
                             data_interval_end=f"{end}T00:00:00+00:00")
        daily.append(stages.prepare_interval(cfg, run, "window_daily"))
    assert len({d.version for d in daily}) == 4

    run = stages.RunInfo("window_mlp", "asset_triggered__1")
    dataset = stages.prepare_data(cfg, run, {"dataset": "window_daily", "end": "2026-11-28T00:00:00+00:00"})
    assert list(dataset.versions) == [d.version for d in daily[1:]]  # the newest three days
    assert dataset.rows == {s: sum(d.rows[s] for d in daily[1:]) for s in ("train", "val", "test")}

    trained = jobs.train(cfg, run, dataset)
    result = json.loads((run.workdir / "train" / "result.json").read_text())
    assert result["dataset_versions"] == list(dataset.versions)
    assert result["world_size"] == 2

    registered = stages.register_model(cfg, run, dataset, trained)
    # The registered model carries the preprocessing of the whole window.
    import mlflow.artifacts

    model_dir = Path(mlflow.artifacts.download_artifacts(f"models:/window_mlp/{registered.version}"))
    carried = json.loads(next(model_dir.rglob("preprocessing.json")).read_text())
    for day in daily[1:]:
        one_day = json.loads((Path(deployment.data_root()) / "window_daily" / day.version / "preprocessing.json").read_text())
        for column, vocab in one_day["vocab"].items():
            assert set(vocab) <= set(carried["vocab"][column])

    evaluation = stages.evaluate(cfg, run, dataset, registered)
    assert evaluation.test_rows == dataset.rows["test"]
    assert evaluation.challenger.metrics["accuracy"] > evaluation.challenger.metrics["majority_rate"]
