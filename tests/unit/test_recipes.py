"""The recipe seam: a registry of recipes, each with its variants, Params, hooks and a thin DAG file."""

import pytest

from pipeline import deployment
from pipeline.errors import ConfigError
from pipeline.recipes import get_recipe, recipe_names
from pipeline.recipes.base import VARIANTS


def test_an_unknown_recipe_is_refused_with_the_names_that_exist():
    with pytest.raises(ConfigError) as err:
        get_recipe("resnet")
    assert "image_classifier" in str(err.value) and "tabular_mlp" in str(err.value)


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_has_its_variants_a_model_section_and_a_thin_dag_file(name):
    recipe = get_recipe(name)
    configs = {variant: recipe.config(variant) for variant in VARIANTS}
    assert all(type(cfg) is recipe.config_class and cfg.RECIPE == name for cfg in configs.values())
    assert any(key.startswith("model.") for key in configs["default"].flat())
    assert configs["tiny"] != configs["default"]
    dag_file = deployment.PROJECT_ROOT / "dags" / f"{name}.py"
    assert len(dag_file.read_text().splitlines()) <= 30
    assert f'recipe_dag("{name}"' in dag_file.read_text()


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_gives_the_hooks_the_stages_call(name):
    spec = get_recipe(name).load_train_spec()
    assert spec.run is not None or all((spec.build_model, spec.batch_transform, spec.loss, spec.export))
    assert spec.package and spec.evaluation_inputs
    cfg = get_recipe(name).config()
    assert cfg.evaluate.metric in spec.evaluator.metrics


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_evaluator_is_one_interface_that_loads_the_model_itself(name):
    import inspect

    from pipeline.evaluate.evaluator import Evaluator

    evaluator = get_recipe(name).load_train_spec().evaluator
    assert isinstance(evaluator, Evaluator)
    assert list(inspect.signature(evaluator.score).parameters)[0] == "model_uri"
    assert not hasattr(evaluator, "score_model")


def test_a_train_spec_without_its_hooks_is_refused():
    from pipeline.train.spec import TrainSpec

    with pytest.raises(TypeError, match="needs run, or build_model"):
        TrainSpec(build_model=lambda cfg, data: None)


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_has_a_synthetic_report_made_by_its_own_evaluator(name):
    """The report's tests (tests/reports.py) cover every recipe, each through the evaluator its TrainSpec names."""
    from tests import reports

    assert name in reports.CASES, "add the recipe's synthetic evaluation to tests/reports.py"
    assert reports.CASES[name]()["evaluator"] is get_recipe(name).load_train_spec().evaluator
