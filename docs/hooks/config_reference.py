"""MkDocs hook: the configuration reference and the recipes' forms, rendered from the code at build time.

A page asks for a generated part with a marker on a line of its own:

- ``<!-- generated: config-sections -->``: every section shared by the recipes (``data``, ``train``,
  ``launch``, ``launch.kubernetes``, ``registry``, ``evaluate``), one table per section, read from the
  dataclasses in ``pipeline/config.py`` (each field's ``what_field``/``where_field(default, help, min=, max=,
  choices=)``, its identity in the column ``is``);
- ``<!-- generated: recipe-configs -->``: per registered recipe, its metrics, its ``model`` section, what
  its config class changes or adds, its variants and its Params form;
- ``<!-- generated: recipe-list -->``: one row per registered recipe (name, description, DAG file).

It imports ``pipeline.config`` and the recipes' light modules (no torch), so the tables are the code's.
"""

from __future__ import annotations

import dataclasses
import html
import json
import logging
import sys
import typing
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.config_reference")

MARKERS = ("config-sections", "recipe-configs", "recipe-list")
ROOT = Path(__file__).resolve().parents[2]


def on_config(config, **kwargs):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return config


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    for name in MARKERS:
        marker = f"<!-- generated: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, RENDERERS[name]())
    return markdown


# -- values as text -------------------------------------------------------------------------------


def cell(text: str) -> str:
    """Text for a table cell: no pipes, no raw HTML, rST literals as Markdown code."""
    text = html.escape(" ".join(str(text).split()), quote=False).replace("|", "\\|")
    return text.replace("``", "`")


def code(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    if isinstance(value, str):
        text = json.dumps(value) if value == "" else value
    return "`" + text.replace("|", "\\|") + "`"


def type_name(hint: Any) -> str:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return f"list[{item.__name__}]"
    return getattr(hint, "__name__", str(hint))


def allowed(rules: typing.Mapping[str, Any]) -> str:
    parts = []
    if "choices" in rules:
        parts.append(", ".join(code(c) for c in rules["choices"]))
    low, high = rules.get("min", rules.get("minimum")), rules.get("max", rules.get("maximum"))
    if low is not None and high is not None:
        parts.append(f"{number(low)} to {number(high)}")
    elif low is not None:
        parts.append(f"≥ {number(low)}")
    elif high is not None:
        parts.append(f"≤ {number(high)}")
    return "; ".join(parts)


def number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


# -- the shared sections --------------------------------------------------------------------------


def sections(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted prefix, dataclass) of every section under ``cls``, depth first, parents first."""
    found = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            found.append((prefix + f.name, hint))
            found += sections(hint, f"{prefix}{f.name}.")
    return found


def field_table(cls: type, prefix: str, only: set[str] | None = None) -> str:
    rows = ["| field | is | type | default | allowed | what |", "| --- | --- | --- | --- | --- | --- |"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) or (only is not None and f.name not in only):
            continue
        rows.append(f"| `{prefix}.{f.name}` | {f.metadata.get('identity', '')} | `{type_name(hint)}` | "
                    f"{code(field_default(f))} | "
                    f"{allowed(f.metadata)} | {cell(f.metadata.get('help', ''))} |")
    return "\n".join(rows)


def render_sections() -> str:
    from pipeline.config import PipelineConfig

    out = []
    for dotted, cls in sections(PipelineConfig):
        if not dataclasses.fields(cls):
            out.append(f"### `{dotted}`\n\nEach recipe's own section: see [the recipes' sections](#per-recipe).\n")
            continue
        doc = cell(cls.__doc__) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""
        out.append(f"### `{dotted}`\n\n`{cls.__module__}.{cls.__qualname__}`{'. ' + doc if doc else ''}\n\n"
                   f"{field_table(cls, dotted)}\n")
    return "\n".join(out)


# -- the recipes ----------------------------------------------------------------------------------


def recipes():
    from pipeline.recipes import get_recipe, recipe_names

    return [get_recipe(name) for name in recipe_names()]


def render_recipe_list() -> str:
    rows = ["| recipe | DAG file | what |", "| --- | --- | --- |"]
    for recipe in recipes():
        dag_file = Path("dags") / f"{recipe.name}.py"
        if not (ROOT / dag_file).is_file():
            log.warning("recipe %s has no DAG file %s", recipe.name, dag_file)
        rows.append(f"| `{recipe.name}` | `{dag_file}` | {cell(recipe.description)} |")
    return "\n".join(rows)


def render_recipe_configs() -> str:
    from pipeline.config import PipelineConfig
    from pipeline.recipes.base import VARIANTS

    base_flat = PipelineConfig().flat()
    out = []
    for recipe in recipes():
        cls = recipe.config_class
        out.append(f"### `{recipe.name}`\n\n{cell(recipe.description)}\n")
        out.append(f"Config class `{cls.__module__}.{cls.__qualname__}`; demo input "
                   f"`$PIPELINE_DATA_DIR/raw/{recipe.demo_path}`; train spec `{recipe.train_spec}`.\n")
        metrics = ", ".join(f"`{name}` ({'higher' if up else 'lower'} is better)" for name, up in cls.METRICS.items())
        out.append(f"Metrics (the names `evaluate.metric` and `evaluate.guardrails` take): {metrics}.\n")

        hints = typing.get_type_hints(cls)
        model_cls = hints["model"]
        if dataclasses.fields(model_cls):
            out.append(f"**`model`** (`{model_cls.__module__}.{model_cls.__qualname__}`)\n\n"
                       f"{field_table(model_cls, 'model')}\n")
        base_hints = typing.get_type_hints(PipelineConfig)
        shown = set()
        for name, hint in hints.items():
            if name == "model" or not dataclasses.is_dataclass(hint) or hint is base_hints.get(name):
                continue
            added = {f.name for f in dataclasses.fields(hint)} - {f.name for f in dataclasses.fields(base_hints[name])}
            redefined = {f.name for f in dataclasses.fields(hint) if f.name in hint.__dict__.get("__annotations__", {})}
            if added | redefined:
                shown |= {f"{name}.{field}" for field in added | redefined}
                out.append(f"**`{name}`** fields that `{hint.__qualname__}` adds or redefines\n\n"
                           f"{field_table(hint, name, only=added | redefined)}\n")

        class_flat = cls().flat()
        changed = {k: v for k, v in class_flat.items() if k in base_flat and base_flat[k] != v
                   and not k.startswith("model.") and k not in shown}
        if changed:
            out.append("Class defaults that differ from the shared sections: "
                       + ", ".join(f"`{k}` = {code(v)}" for k, v in changed.items()) + ".\n")

        variants = {v: recipe.config(v).flat() for v in VARIANTS}
        keys = [k for k in class_flat if k != "data.input_path"
                and any(variants[v][k] != class_flat[k] for v in VARIANTS)]
        rows = ["| field | class default | " + " | ".join(f"`{v}`" for v in VARIANTS) + " |",
                "| --- | --- | " + " | ".join("---" for _ in VARIANTS) + " |"]
        for key in keys:
            rows.append(f"| `{key}` | {code(class_flat[key])} | "
                        + " | ".join(code(variants[v][key]) for v in VARIANTS) + " |")
        out.append("**Variants** (`data.input_path` is the demo input in each)\n\n" + "\n".join(rows) + "\n")

        params = recipe.airflow_params()
        rows = ["| Param | config field | default | allowed |", "| --- | --- | --- | --- |"]
        for name, schema in params.items():
            dotted = recipe.form.get(name, "")
            default = schema.get("default")
            if dotted == "data.input_path":
                default_text = f"`$PIPELINE_DATA_DIR/raw/{recipe.demo_path}`"
            else:
                default_text = code(default)
            rules = dict(schema.get("items", {})) | {k: v for k, v in schema.items() if k in ("minimum", "maximum")}
            rules |= {"choices": schema["enum"]} if "enum" in schema else {}
            if "enum" in schema.get("items", {}):
                rules["choices"] = schema["items"]["enum"]
            kind = schema.get("type", "")
            if kind == "array":
                kind = f"list of {schema['items']['type']}"
            rules_text = allowed({k: v for k, v in rules.items() if k in ("minimum", "maximum", "choices")})
            rows.append(f"| `{name}` | {f'`{dotted}`' if dotted else '—'} | {default_text} | "
                        f"{kind}{'; ' + rules_text if rules_text else ''} |")
        out.append("**Params form** (the trigger form in the Airflow UI, or `conf` of a triggered run)\n\n"
                   + "\n".join(rows) + "\n")
    return "\n".join(out)


RENDERERS = {"config-sections": render_sections, "recipe-configs": render_recipe_configs,
             "recipe-list": render_recipe_list}
