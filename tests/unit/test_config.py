import json

import pytest

from pipeline.config import PipelineConfig, param_schema, parse_set_args
from pipeline.errors import ConfigError
from pipeline.recipes import tabular_mlp


def test_round_trip_through_dict_and_json():
    cfg = tabular_mlp.config("tiny")
    again = PipelineConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert again.digest() == cfg.digest()


def test_unknown_key_is_refused_with_the_keys_that_exist():
    raw = PipelineConfig().to_dict()
    raw["train"]["lr"] = 0.1
    with pytest.raises(ConfigError) as err:
        PipelineConfig.from_dict(raw)
    assert "'lr'" in str(err.value) and "learning_rate" in str(err.value)


def test_unknown_section_is_refused():
    with pytest.raises(ConfigError, match="SECTION one of"):
        PipelineConfig().with_overrides({"trainer.epochs": 2})


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("train.epochs", 0, "train.epochs=0: expected a value >= 1"),
        ("train.learning_rate", "fast", "expected float"),
        ("launch.backend", "mpi", "expected one of ['auto', 'gloo', 'nccl']"),
        ("train.hidden_sizes", [64, 0], "train.hidden_sizes[1]=0: expected a value >= 1"),
        ("train.batch_size", True, "expected int, got bool"),
        ("data.val_fraction", 0.9, "expected a value <= 0.5"),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_allowed(key, value, expected):
    with pytest.raises(ConfigError) as err:
        PipelineConfig().with_overrides({key: value})
    assert expected in str(err.value)


def test_set_args_parse_json_values_and_fall_back_to_text():
    overrides = parse_set_args(["train.learning_rate=3e-4", "train.hidden_sizes=[64,32]", "registry.model_name=abc"])
    cfg = PipelineConfig().with_overrides(overrides)
    assert cfg.train.learning_rate == pytest.approx(3e-4)
    assert cfg.train.hidden_sizes == [64, 32]
    assert cfg.registry.model_name == "abc"
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_set_args(["train.epochs"])


def test_params_mirror_the_config_rules():
    params = tabular_mlp.airflow_params()
    assert params["epochs"]["type"] == "integer" and params["epochs"]["minimum"] == 1
    assert params["hidden_sizes"]["type"] == "array" and params["hidden_sizes"]["items"]["type"] == "integer"
    assert params["learning_rate"]["default"] == tabular_mlp.config().train.learning_rate
    assert all(p.get("description") for p in params.values())
    assert param_schema("launch.backend", "auto")["enum"] == ["auto", "gloo", "nccl"]


def test_config_from_params_applies_params_and_overrides():
    cfg = tabular_mlp.config_from_params({"epochs": 7, "hidden_sizes": [8], "overrides": {"train.dropout": 0.3}})
    assert (cfg.train.epochs, cfg.train.hidden_sizes, cfg.train.dropout) == (7, [8], 0.3)
    with pytest.raises(ConfigError, match="unknown key"):
        tabular_mlp.config_from_params({"overrides": {"train.momentum": 0.9}})
