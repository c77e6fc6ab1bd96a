"""Idempotent registration: concurrent attempts with one run key leave exactly one model version."""

import json
import threading

import pytest

from tests.services import MlflowServer, PostgresDatabase

ATTEMPTS = 8


@pytest.fixture(params=["sqlite-store", "server-on-postgres"])
def tracking_uri(request, tmp_path, monkeypatch):
    if request.param == "sqlite-store":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
        monkeypatch.setenv("PIPELINE_MLFLOW_ARTIFACTS", (tmp_path / "artifacts").as_uri())
        yield "sqlite"
        return
    database = PostgresDatabase()
    server = MlflowServer(database.url, tmp_path / "server-artifacts", workers=2)
    try:
        server.start()
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
        monkeypatch.delenv("PIPELINE_MLFLOW_ARTIFACTS", raising=False)
        yield server.url
    finally:
        server.stop()
        database.close()


def _tiny_package(tmp_path):
    """The tabular recipe's package of a small untrained network: what register_model logs."""
    import pandas as pd
    import torch

    from pipeline.recipes.tabular_mlp.model import ModelSpec, TabularMLP
    from pipeline.recipes.tabular_mlp.train import SERVING
    from pipeline.registry.package import ModelPackage
    from pipeline.train.export import export_network

    spec = ModelSpec(num_numeric=2, cardinalities=[3], num_classes=2, hidden_sizes=[4], dropout=0.0)
    network = export_network(TabularMLP(spec), (torch.zeros(2, 2), torch.zeros(2, 1, dtype=torch.int64)),
                             tmp_path / "network.pt2")
    prep = {"numeric_columns": ["a", "b"], "categorical_columns": ["c"], "vocab": {"c": ["<unk>", "x", "y"]},
            "mean": [0.0, 0.0], "std": [1.0, 1.0], "label_classes": [0, 1]}
    (tmp_path / "preprocessing.json").write_text(json.dumps(prep))
    return ModelPackage(python_model=str(SERVING), input_example=pd.DataFrame([{"a": 1.0, "b": 2.0, "c": "x"}]),
                        artifacts={"network": str(network), "preprocessing": str(tmp_path / "preprocessing.json")})


def test_concurrent_registrations_with_one_run_key_give_one_version(tracking_uri, tmp_path, caplog):
    import logging

    from pipeline.registry import models, tracking

    caplog.set_level(logging.INFO, logger="pipeline.registry.models")

    package = _tiny_package(tmp_path)
    run_key = "concurrency/run-1"
    run_id = tracking.ensure_run("concurrency", run_key, {})
    barrier = threading.Barrier(ATTEMPTS)
    outcomes, errors = [], []

    def attempt():
        barrier.wait()
        try:
            outcomes.append(models.log_and_register(
                run_id=run_id, model_name="racer", run_key=run_key, package=package, tags={}))
        except Exception as exc:  # collected so the assertion shows it
            errors.append(repr(exc))

    threads = [threading.Thread(target=attempt) for _ in range(ATTEMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)

    assert errors == []
    survivors = tracking.client().search_model_versions("name = 'racer'")
    assert len(survivors) == 1, [(v.version, v.tags) for v in survivors]
    assert {version for version, _ in outcomes} == {str(survivors[0].version)}
    assert sum(created for _, created in outcomes) == 1
    # A retry after the race finds the version and registers nothing.
    again = models.log_and_register(run_id=run_id, model_name="racer", run_key=run_key, package=package, tags={})
    assert again == (str(survivors[0].version), False)
    lost = sum("lost a registration race" in r.getMessage() for r in caplog.records)
    found = sum("already registered" in r.getMessage() for r in caplog.records)
    print(f"{tracking_uri}: {ATTEMPTS} concurrent attempts: {lost + 1} registered a version, {lost} deleted theirs "
          f"after losing the race, {found} found it before registering; 1 version kept")


def test_a_model_that_fails_on_its_input_example_is_not_registered(tmp_path, monkeypatch):
    """MLflow only warns when the model fails on its example; registration refuses it, as a user error."""
    import dataclasses

    import pandas as pd

    from pipeline.errors import UserError
    from pipeline.registry import models, tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("PIPELINE_MLFLOW_ARTIFACTS", (tmp_path / "artifacts").as_uri())
    package = dataclasses.replace(_tiny_package(tmp_path), input_example=pd.DataFrame([{"a": 1.0, "c": "x"}]))
    run_id = tracking.ensure_run("broken", "broken/run-1", {})
    with pytest.raises(UserError, match=r"model broken \(pyfunc\) failed on its input example"):
        models.log_and_register(run_id=run_id, model_name="broken", run_key="broken/run-1", package=package, tags={})
    assert tracking.client().search_model_versions("name = 'broken'") == []


def test_runs_of_one_experiment_record_the_same_dataset_at_once(tracking_uri):
    """A sweep's trials start side by side, each run recording the one dataset version: the store inserts the
    experiment's dataset row once, and a run that loses that race must still get its input."""
    from pipeline.registry import tracking

    for round_ in range(3):
        runs = [tracking.ensure_run("concurrent_inputs", f"inputs/{round_}/{i}", {}) for i in range(ATTEMPTS)]
        start, errors = threading.Barrier(ATTEMPTS), []

        def record(run_id: str) -> None:
            start.wait()
            try:
                tracking.log_dataset_input(run_id, name="tabular_mlp", digest=f"digest-{round_}",
                                           source_uri="file:///data/tabular_mlp/v", profile={"rows": 10})
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=record, args=(run_id,)) for run_id in runs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        for run_id in runs:
            (recorded,) = tracking.client().get_run(run_id).inputs.dataset_inputs
            assert recorded.dataset.digest == f"digest-{round_}"
