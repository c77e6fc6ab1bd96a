import json

import pytest

from pipeline.config import PipelineConfig
from pipeline.config_fields import parse_set_args
from pipeline.errors import ConfigError
from pipeline.recipes import get_recipe, recipe_names, tabular_mlp
from pipeline.recipes.image_classifier import ImageConfig
from pipeline.recipes.tabular_mlp import TabularConfig


def test_round_trip_through_dict_and_json():
    cfg = tabular_mlp.config("tiny")
    again = TabularConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert again.digest() == cfg.digest()


def test_unknown_key_is_refused_with_the_keys_that_exist():
    raw = TabularConfig().to_dict()
    raw["train"]["lr"] = 0.1
    with pytest.raises(ConfigError) as err:
        TabularConfig.from_dict(raw)
    assert "'lr'" in str(err.value) and "learning_rate" in str(err.value)


def test_unknown_section_or_nested_field_is_refused_with_the_keys_that_exist():
    with pytest.raises(ConfigError, match="unknown config key 'trainer.epochs'") as err:
        TabularConfig().with_overrides({"trainer.epochs": 2})
    assert "'model'" in str(err.value) and "'train'" in str(err.value)
    with pytest.raises(ConfigError, match="unknown config key 'model.depth'") as err:
        TabularConfig().with_overrides({"model.depth": 2})  # the image recipe's field, not this one's
    assert "model.hidden_sizes" in str(err.value)


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("train.epochs", 0, "train.epochs=0: expected a value >= 1"),
        ("train.learning_rate", "fast", "expected float"),
        ("launch.backend", "mpi", "expected one of ['auto', 'gloo', 'nccl']"),
        ("launch.kind", "slurm", "launch.kind='slurm': expected one of ['local', 'kubernetes', 'ray']"),
        ("model.hidden_sizes", [64, 0], "model.hidden_sizes[1]=0: expected a value >= 1"),
        ("train.batch_size", True, "expected int, got bool"),
        ("data.val_fraction", 0.9, "expected a value <= 0.5"),
        ("evaluate.metric", "recall_at_10", "evaluate.metric='recall_at_10': expected one of this recipe's metrics"),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_allowed(key, value, expected):
    with pytest.raises(ConfigError) as err:
        TabularConfig().with_overrides({key: value})
    assert expected in str(err.value)


def test_nested_model_fields_are_reached_the_same_way_from_set_params_and_mlflow_params():
    overrides = parse_set_args(["model.depth=3", "model.widths=[8,16]", "train.learning_rate=3e-4",
                                "registry.model_name=abc"])
    recipe = get_recipe("image_classifier")
    from_cli = recipe.config().with_overrides(overrides)
    assert (from_cli.model.depth, from_cli.model.widths, from_cli.registry.model_name) == (3, [8, 16], "abc")
    from_params = recipe.config_from_params({"depth": 3, "widths": [8, 16], "learning_rate": 3e-4,
                                             "model_name": "abc"})
    assert from_params == from_cli
    # MLflow keeps params as text under dotted keys: the config comes back from them unchanged.
    assert from_cli.as_params()["model.widths"] == "[8, 16]"
    assert ImageConfig.from_flat(from_cli.as_params() | {"launch.world_size": "2"}) == from_cli
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_set_args(["train.epochs"])


def test_params_mirror_the_config_rules():
    params = tabular_mlp.airflow_params()
    assert params["epochs"]["type"] == "integer" and params["epochs"]["minimum"] == 1
    assert params["hidden_sizes"]["type"] == "array" and params["hidden_sizes"]["items"]["type"] == "integer"
    assert params["learning_rate"]["default"] == tabular_mlp.config().train.learning_rate
    assert params["variant"]["enum"] == ["default", "demo", "tiny"]
    assert all(p.get("description") for p in params.values())
    assert TabularConfig.param_schema("launch.backend", "auto")["enum"] == ["auto", "gloo", "nccl"]
    assert TabularConfig.param_schema("evaluate.metric", "accuracy")["enum"] == ["accuracy", "log_loss", "macro_f1"]


@pytest.mark.parametrize("name", recipe_names())
def test_the_overrides_help_names_keys_the_config_accepts(name):
    import re

    recipe = get_recipe(name)
    help_text = recipe.airflow_params()["overrides"]["description"]
    example = json.loads(re.search(r"(\{.*\})", help_text).group(1))
    cfg = recipe.config_from_params({"overrides": example})
    assert cfg.flat().items() >= example.items()


def test_config_from_params_applies_the_variant_params_and_overrides():
    cfg = tabular_mlp.config_from_params({"epochs": 7, "hidden_sizes": [8], "overrides": {"model.dropout": 0.3}})
    assert (cfg.train.epochs, cfg.model.hidden_sizes, cfg.model.dropout) == (7, [8], 0.3)
    # The form sends every Param; those left at their defaults do not undo what the variant sets.
    defaults = {name: schema["default"] for name, schema in tabular_mlp.airflow_params().items()}
    tiny = tabular_mlp.config_from_params(defaults | {"variant": "tiny"})
    assert tiny == tabular_mlp.config("tiny")
    assert tabular_mlp.config_from_params(defaults | {"variant": "tiny", "epochs": 9}).train.epochs == 9
    with pytest.raises(ConfigError, match="unknown config key"):
        tabular_mlp.config_from_params({"overrides": {"train.momentum": 0.9}})


def test_a_plain_pipeline_config_takes_any_metric_name():
    assert PipelineConfig().with_overrides({"evaluate.metric": "anything"}).evaluate.metric == "anything"


def test_the_serialized_config_carries_its_recipe_and_is_read_back_as_that_recipes_config():
    from pipeline.recipes import config_from_dict

    raw = json.loads(json.dumps(get_recipe("image_classifier").config("tiny").to_dict()))
    assert raw["recipe"] == "image_classifier"
    cfg = config_from_dict(raw)
    assert isinstance(cfg, ImageConfig) and cfg == get_recipe("image_classifier").config("tiny")
    with pytest.raises(ConfigError, match="recipe='image_classifier': this is a config of the tabular_mlp recipe"):
        TabularConfig.from_dict(raw)
    with pytest.raises(ConfigError, match="expected a mapping with its 'recipe'"):
        config_from_dict({k: v for k, v in raw.items() if k != "recipe"})


def test_the_settings_leave_out_where_it_runs_and_read_back_with_the_default_launch():
    from pipeline.launch_config import LaunchConfig
    from pipeline.recipes import config_from_dict

    cfg = get_recipe("two_tower").config("tiny").with_overrides({
        "launch.kind": "kubernetes", "launch.nproc_per_node": 8, "launch.kubernetes.namespace": "team-b"})
    settings = json.loads(json.dumps(cfg.settings()))
    assert set(settings) == set(cfg.to_dict()) - {"launch"} and settings["recipe"] == "two_tower"
    assert set(cfg.as_params()) == {key for key in cfg.flat() if not key.startswith("launch.")}
    back = config_from_dict(settings)  # what a rank reads from its config file
    assert back.launch == LaunchConfig() and back.settings() == cfg.settings() and back.digest() == cfg.digest()
    assert type(cfg).from_flat(cfg.as_params()).settings() == cfg.settings()


def test_a_rank_finds_its_recipe_in_the_config_and_its_job_folder_in_the_environment(tmp_path, monkeypatch):
    from pipeline.rank import parse_args, resolve

    config = tmp_path / "config.json"
    config.write_text(json.dumps(get_recipe("two_tower").config("tiny").settings()))  # as the train task writes it
    monkeypatch.setenv("PIPELINE_JOB_DIR", str(tmp_path / "job"))
    recipe, cfg, out = resolve(parse_args(["--config", str(config), "--dataset", "d", "--set", "train.epochs=3"]))
    assert (recipe.name, cfg.RECIPE, cfg.train.epochs, out) == ("two_tower", "two_tower", 3, tmp_path / "job")
    with pytest.raises(ConfigError, match="--recipe tabular_mlp: the config .* is of the two_tower recipe"):
        resolve(parse_args(["--config", str(config), "--recipe", "tabular_mlp", "--dataset", "d"]))
    monkeypatch.delenv("PIPELINE_JOB_DIR")
    with pytest.raises(ConfigError, match="needs --out DIR when no place exported PIPELINE_JOB_DIR"):
        resolve(parse_args(["--config", str(config), "--dataset", "d"]))
