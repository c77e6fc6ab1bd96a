"""The registry of recipes: one module per workload, looked up by name (light: no torch here).

A recipe outside this package registers through the ``ddp_pipelines.recipes`` entry point group
(``NAME = "package.module"``, the module holding ``RECIPE``).
"""

from __future__ import annotations

import importlib
from functools import cache

from pipeline.errors import ConfigError

BUILT_IN = {
    "tabular_mlp": "pipeline.recipes.tabular_mlp",
    "image_classifier": "pipeline.recipes.image_classifier",
    "llm_sft": "pipeline.recipes.llm_sft",
    "two_tower": "pipeline.recipes.two_tower",
}
ENTRY_POINT_GROUP = "ddp_pipelines.recipes"


@cache
def registry() -> dict[str, str]:
    """Recipe name -> module, built-in ones and those of installed packages."""
    from importlib.metadata import entry_points

    found = dict(BUILT_IN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def get_recipe(name: str):
    """The ``Recipe`` registered as ``name``."""
    modules = registry()
    if name not in modules:
        raise ConfigError(f"unknown recipe {name!r}: the recipes that exist are {sorted(modules)}")
    return importlib.import_module(modules[name]).RECIPE


def config_from_dict(raw: dict):
    """A serialized config (``PipelineConfig.to_dict``) as its recipe's config: the config names its recipe."""
    if not isinstance(raw, dict) or not raw.get("recipe"):
        raise ConfigError(f"config: expected a mapping with its 'recipe' (one of {recipe_names()}), got keys "
                          f"{sorted(raw) if isinstance(raw, dict) else type(raw).__name__}")
    return get_recipe(raw["recipe"]).config_class.from_dict(raw)


def recipe_names() -> list[str]:
    return sorted(registry())
