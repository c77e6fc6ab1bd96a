"""A sweep's study on a real Optuna storage (SQLite): trials bound to slots and found again, and the pruner reading
a trial job's metrics file as rank 0 writes it (``MetricsSink``)."""

from __future__ import annotations

import pytest

from pipeline.errors import ConfigError
from pipeline.job_files import MetricsSink
from pipeline.recipes import get_recipe
from pipeline.sweep.pruning import EpochPruner
from pipeline.sweep.study import SLOT, Sweep

BASE = get_recipe("tabular_mlp").config("tiny")


@pytest.fixture()
def sweep(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_SWEEP_DB", f"sqlite:///{tmp_path / 'optuna.db'}")
    return Sweep.from_params({"search_space": {"train.learning_rate": {"low": 1e-4, "high": 1e-1, "log": True}},
                              "n_trials": 6, "prune_after_trials": 1, "prune_after_epochs": 0,
                              "enqueue": [{"train.learning_rate": 0.01}]}, BASE)


def _epochs(path, values, start=1):
    sink = MetricsSink(path)
    for epoch, value in enumerate(values, start):
        sink.log({"train_loss": value + 0.1}, step=epoch * 10 - 5)  # a step line: no epoch, not reported
        sink.log({"val_loss": value, "val_accuracy": 1 - value, "epoch": epoch}, step=epoch * 10)
    sink.close()


def test_a_slot_finds_its_trial_again_until_it_finishes_and_a_failed_one_asks_anew(sweep):
    from optuna.trial import FrozenTrial, TrialState

    study = sweep.create_study("dag/run-1")
    first = sweep.trial_for(study, 0)
    assert first.params == {"train.learning_rate": 0.01}  # the point to try first
    again = sweep.trial_for(study, 0)  # a retry of slot 0's task: the same trial, so the same job folder and params
    assert again.number == first.number and again.params == first.params
    other = sweep.trial_for(study, 1)
    assert other.number != first.number and 1e-4 <= other.params["train.learning_rate"] <= 1e-1

    study.tell(first, 0.5)
    done = sweep.trial_for(study, 0)
    assert isinstance(done, FrozenTrial) and done.state == TrialState.COMPLETE and done.number == first.number

    study.tell(other, state=TrialState.FAIL)
    fresh = sweep.trial_for(sweep.load_study("dag/run-1"), 1)  # a cleared sweep: slot 1 gets a new trial
    assert fresh.number not in (first.number, other.number) and fresh.user_attrs[SLOT] == 1

    # The same DAG run's study, opened by another process, holds the same trials; another run's is its own.
    assert len(sweep.load_study("dag/run-1").trials) == 3
    assert sweep.trial_for(sweep.create_study("dag/run-2"), 0).params == {"train.learning_rate": 0.01}
    with pytest.raises(RuntimeError, match="no sweep study 'dag/run-3'"):
        sweep.load_study("dag/run-3")


def test_the_pruner_reports_each_epoch_once_and_stops_a_trial_worse_than_the_median(sweep, tmp_path):
    study = sweep.create_study("dag/run")
    good = sweep.trial_for(study, 0)
    path = tmp_path / "good" / "metrics.jsonl"
    _epochs(path, [0.9, 0.7, 0.5])
    pruner = EpochPruner(good, path, "val_loss")
    assert pruner() is None  # the first trial: nothing to compare with
    assert study.trials[0].intermediate_values == {1: 0.9, 2: 0.7, 3: 0.5}
    study.tell(good, 0.5)

    bad = sweep.trial_for(study, 1)
    path = tmp_path / "bad" / "metrics.jsonl"
    _epochs(path, [0.8])
    pruner = EpochPruner(bad, path, "val_loss")
    assert pruner() is None  # 0.8 at epoch 1 is better than 0.9
    assert pruner() is None  # nothing new: nothing asked
    with open(path, "a") as fh:
        fh.write('{"step": 20, "timestamp": 1, "metrics": {"val_lo')  # rank 0 still writing the line: not read yet
    _epochs(path, [0.95], start=2)  # a killed attempt's cut line, then the next epoch on a line of its own
    reason = pruner()
    assert reason and f"trial {bad.number} pruned after epoch 2: val_loss 0.95" in reason
    assert study.trials[bad.number].intermediate_values == {1: 0.8, 2: 0.95}

    # A retried trial task reads the file from the start: epochs already reported are not reported again.
    assert EpochPruner(sweep.trial_for(study, 1), path, "val_loss")() is not None


def test_an_objective_the_epoch_lines_lack_is_a_clear_error(sweep, tmp_path):
    study = sweep.create_study("dag/run")
    path = tmp_path / "metrics.jsonl"
    _epochs(path, [0.9])
    with pytest.raises(ConfigError, match=r"objective='val_f1': the epoch lines of .* have \['val_accuracy', 'val_loss'\]"):
        EpochPruner(sweep.trial_for(study, 0), path, "val_f1")()
