"""A sweep's search space and settings checked against a recipe's config fields before any trial starts."""

from __future__ import annotations

import jsonschema
import pytest

from pipeline.errors import ConfigError
from pipeline.recipes import get_recipe
from pipeline.sweep.space import SearchSpace
from pipeline.sweep.study import Sweep, airflow_params, direction

BASE = get_recipe("tabular_mlp").config("tiny")


def test_ranges_and_choices_become_typed_dimensions_and_overrides():
    space = SearchSpace.parse({
        "train.learning_rate": {"low": 1e-4, "high": 1e-2, "log": True},
        "train.batch_size": {"low": 32, "high": 256, "step": 32},
        "model.hidden_sizes": {"choices": [[64, 32], [128, 64]]},
    }, BASE)
    lr, batch, hidden = space.dimensions
    assert (lr.kind, lr.low, lr.high, lr.log) == (float, 1e-4, 1e-2, True)
    assert (batch.kind, batch.low, batch.high, batch.step) == (int, 32, 256, 32)
    assert hidden.choices == ([64, 32], [128, 64])
    # Optuna's choices are scalars: a list choice travels as JSON text and comes back as the list.
    import optuna

    trial = optuna.create_study().ask()
    assert hidden.suggest(trial) in ("[64, 32]", "[128, 64]") and 32 <= batch.suggest(trial) <= 256
    assert trial.distributions["model.hidden_sizes"].choices == ("[64, 32]", "[128, 64]")
    overrides = space.overrides({"train.learning_rate": 0.003, "train.batch_size": 64, "model.hidden_sizes": "[128, 64]"})
    assert overrides == {"train.learning_rate": 0.003, "train.batch_size": 64, "model.hidden_sizes": [128, 64]}
    assert BASE.with_overrides(overrides).model.hidden_sizes == [128, 64]


@pytest.mark.parametrize("raw, expected", [
    ({"train.learnig_rate": {"low": 0.1, "high": 0.2}}, "no such config field"),
    ({"data.val_fraction": {"low": 0.1, "high": 0.2}}, "only model.* and train.* fields are searched"),
    ({"launch.nproc_per_node": {"choices": [1, 2]}}, "only model.* and train.* fields are searched"),
    ({"train.learning_rate": {"low": 0.1, "high": 0.01}}, "low=0.1 is not below high=0.01"),
    ({"train.learning_rate": {"low": 1e-4, "high": 2.0}}, "train.learning_rate must be <= 1.0"),
    ({"train.weight_decay": {"low": 0.0, "high": 0.1, "log": True}}, "log=true needs low > 0"),
    ({"train.batch_size": {"low": 16.5, "high": 64}}, "int field; expected a whole number"),
    ({"train.lr_schedule": {"low": 1, "high": 2}}, "a range needs an int or float field"),
    ({"train.lr_schedule": {"choices": ["constant", "linear"]}}, "choices[1]"),
    ({"train.epochs": {"choices": []}}, "expected a non-empty list"),
    ({"train.epochs": {"low": 1}}, "missing ['high']"),
    ({"train.epochs": {"low": 1, "high": 4, "step": 5}}, "step=5"),
    ({"train.epochs": {"min": 1, "max": 4}}, "expected a range"),
    ({}, "expected a non-empty mapping"),
])
def test_a_bad_space_names_the_field_the_value_and_what_was_expected(raw, expected):
    with pytest.raises(ConfigError) as info:
        SearchSpace.parse(raw, BASE)
    assert expected in str(info.value)
    if raw:
        assert next(iter(raw)) in str(info.value)


def test_the_param_schema_refuses_an_unknown_field_or_a_malformed_range_at_trigger_time():
    """What Airflow checks when a run is triggered (the form or the REST API), before a run exists."""
    schema = {k: v for k, v in airflow_params(BASE)["search_space"].items() if k not in ("default", "description")}
    jsonschema.validate({"train.learning_rate": {"low": 1e-4, "high": 1e-2, "log": True}}, schema)
    jsonschema.validate({"model.hidden_sizes": {"choices": [[8], [16]]}}, schema)
    for bad in ({"train.learnig_rate": {"low": 1e-4, "high": 1e-2}}, {"train.learning_rate": {"low": 1e-4}},
                {"train.learning_rate": {"low": "small", "high": 1.0}}, {"data.val_fraction": {"choices": [0.1]}}, {},
                {"train.learning_rate": {"low": 1e-4, "high": 2.0}}, {"train.epochs": {"choices": [2, 0]}},
                {"train.learning_rate": {"high": 1e-2, "log": True}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_sweep_settings_check_their_values_and_the_points_to_try_first():
    params = {"search_space": {"train.learning_rate": {"low": 1e-4, "high": 1e-2}}, "n_trials": 4}
    sweep = Sweep.from_params(params | {"enqueue": [{"train.learning_rate": 0.003}]}, BASE)
    assert sweep.config.n_trials == 4 and sweep.direction == "minimize" and sweep.enqueue == ({"train.learning_rate": 0.003},)
    with pytest.raises(ConfigError, match=r"n_trials=0: expected a value >= 1"):
        Sweep.from_params(params | {"n_trials": 0}, BASE)
    with pytest.raises(ConfigError, match=r"pruner='hyperband': expected one of"):
        Sweep.from_params(params | {"pruner": "hyperband"}, BASE)
    with pytest.raises(ConfigError, match=r"enqueue\[0\]: field\(s\) \['train.epochs'\] are not in the search space"):
        Sweep.from_params(params | {"enqueue": [{"train.epochs": 3}]}, BASE)
    with pytest.raises(ConfigError, match=r"train.learning_rate=5.0: expected a value <= 1.0"):
        Sweep.from_params(params | {"enqueue": [{"train.learning_rate": 5.0}]}, BASE)


def test_direction_follows_the_objective_unless_chosen():
    assert direction("val_loss", "auto", BASE) == "minimize"
    assert direction("val_accuracy", "auto", BASE) == "maximize"  # accuracy: higher is better
    assert direction("val_accuracy", "minimize", BASE) == "minimize"
    with pytest.raises(ConfigError, match=r"objective='val_widgets' is neither a loss nor val_<metric>"):
        direction("val_widgets", "auto", BASE)
