"""What is trained, apart from where it runs: a run moved to another Kubernetes namespace, image or number of
ranks keeps its config digest, its MLflow params, its model's lineage tags and the ranks' config file; a
training field changes them. Through what the train task calls (``stages.train_job``, ``stages.lineage_tags``)
against a real MLflow (SQLite)."""

from __future__ import annotations

import json

import pytest

from pipeline import stages
from pipeline.recipes import tabular_mlp
from pipeline.results import PreparedData
from pipeline.stages.run import RunInfo

DATASET = PreparedData(name="tabular_mlp", uri="file:///data/tabular_mlp/v1", version="v1",
                       uris=("file:///data/tabular_mlp/v1",), versions=("v1",), rows={"train": 80, "val": 10, "test": 10})

ELSEWHERE = {
    "namespace": {"launch.kind": "kubernetes", "launch.kubernetes.namespace": "team-b"},
    "image": {"launch.kind": "kubernetes", "launch.kubernetes.image": "registry.example/ddp-pipelines:2"},
    "nproc_per_node": {"launch.nproc_per_node": 8},
}


@pytest.fixture(scope="module")
def trained_as(tmp_path_factory):
    """``trained_as(cfg, run_id)``: the train task's job of ``cfg`` for a DAG run, as its MLflow run's params and
    tags and the ranks' config file (``stages.train_job``, on a module-wide MLflow and runs folder)."""
    root = tmp_path_factory.mktemp("lineage")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PIPELINE_RUNS_DIR", str(root / "runs"))
        env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        env.setenv("PIPELINE_CODE_VERSION", "test")
        from pipeline.registry import tracking

        def trained_as(cfg, run_id: str):
            spec = stages.train_job(cfg, RunInfo("tabular_mlp", run_id), DATASET)
            data = tracking.client().get_run(spec.env["MLFLOW_RUN_ID"]).data
            return data.params, data.tags, json.loads(spec.files.config.read_text())

        yield trained_as


@pytest.mark.parametrize("where", sorted(ELSEWHERE))
def test_where_a_run_goes_leaves_its_digest_params_lineage_and_the_ranks_config_alone(trained_as, where):
    here = tabular_mlp.config("tiny")
    there = here.with_overrides(ELSEWHERE[where])
    assert there.launch != here.launch
    assert there.digest() == here.digest()
    run = RunInfo("tabular_mlp", "manual__1")
    assert stages.lineage_tags(there, run, DATASET) == stages.lineage_tags(here, run, DATASET)

    params, tags, ranks_config = trained_as(here, f"here-{where}")
    params_there, tags_there, ranks_config_there = trained_as(there, f"there-{where}")
    assert params_there == params and params["train.learning_rate"] == json.dumps(here.train.learning_rate)
    assert not [key for key in params if key.startswith("launch.")]
    assert tags_there["config.digest"] == tags["config.digest"] == here.digest()
    assert ranks_config_there == ranks_config and "launch" not in ranks_config
    # Where it went is still told, as a tag of its MLflow run only.
    assert tags_there["launch.world_size"] == str(there.launch.nnodes * there.launch.nproc_per_node)


def test_a_training_field_changes_the_digest_the_params_and_the_lineage(trained_as):
    here = tabular_mlp.config("tiny")
    faster = here.with_overrides({"train.learning_rate": here.train.learning_rate * 2})
    assert faster.digest() != here.digest()
    run = RunInfo("tabular_mlp", "manual__1")
    assert (stages.lineage_tags(faster, run, DATASET)["config.digest"]
            != stages.lineage_tags(here, run, DATASET)["config.digest"])
    params, tags, ranks_config = trained_as(here, "here-lr")
    params_faster, tags_faster, ranks_config_faster = trained_as(faster, "faster-lr")
    assert {k for k in params if params[k] != params_faster[k]} == {"train.learning_rate"}
    assert tags_faster["config.digest"] == faster.digest() != tags["config.digest"]
    assert ranks_config_faster["train"]["learning_rate"] == faster.train.learning_rate
