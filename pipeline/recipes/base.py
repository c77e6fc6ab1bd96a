"""The recipe interface: what a workload provides to the shared stages, DAG factory and training loop.

A ``Recipe`` is light (no torch): its config variants, the Params of its trigger form and where its
heavy parts live. Those parts (``TrainSpec``: model, batch transform, loss, export, packaging,
evaluation inputs; or a per-rank body for a framework trainer) are imported by name only where they
run: in the ranks, the register and the evaluate stages.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from pipeline.config import PipelineConfig
from pipeline.errors import ConfigError

VARIANTS = ("default", "demo", "tiny")

# Params every recipe's form has, beside the recipe's own.
COMMON_PARAMS: dict[str, str] = {
    "model_name": "registry.model_name",
    "nproc_per_node": "launch.nproc_per_node",
    "max_restarts": "launch.max_restarts",
    "epochs": "train.epochs",
    "batch_size": "train.batch_size",
    "learning_rate": "train.learning_rate",
    "seed": "train.seed",
    "checkpoint_every_steps": "train.checkpoint_every_steps",
    "require_approval": "evaluate.require_approval",
}


@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str
    description: str
    config_class: type[PipelineConfig]
    defaults: Mapping[str, Any]  # the default variant: dotted overrides of the config class's defaults
    variants: Mapping[str, Mapping[str, Any]]  # variant -> dotted overrides of the default variant
    params: Mapping[str, str]  # the recipe's own Params form fields -> dotted config fields
    train_spec: str  # "module:ATTR" of its ``pipeline.train.spec.TrainSpec`` (imported in the ranks)
    demo_path: str  # where the demo's input lies, under $PIPELINE_DATA_DIR/raw/
    write_demo: Callable[[Path], Any]  # writes the demo's input to that path
    tags: tuple[str, ...] = ()
    prep_params: tuple[str, ...] = field(default=("input_path", "overrides"))  # of a DAG that only prepares data

    def config(self, variant: str = "default") -> PipelineConfig:
        """The recipe's config; ``demo`` is what ``make demo`` runs, ``tiny`` what the tests run."""
        if variant not in VARIANTS:
            raise ConfigError(f"variant={variant!r}: expected one of {list(VARIANTS)}")
        return self.config_class().with_overrides({
            "data.input_path": self.demo_input_path(), "registry.model_name": self.name,
            "registry.experiment": self.name, **self.defaults, **self.variants.get(variant, {}),
        })

    def demo_input_path(self) -> str:
        from pipeline import deployment

        return str(deployment.raw_dir() / self.demo_path)

    def demo_input(self) -> str:
        """The demo's input, written first when it is not there yet."""
        path = Path(self.demo_input_path())
        if not path.exists():
            print(f"writing the {self.name} demo's input to {path}", flush=True)
            self.write_demo(path)
        return str(path)

    @property
    def form(self) -> dict[str, str]:
        """Params form field -> config field: the recipe's own, then the common ones."""
        return {**self.params, **COMMON_PARAMS}

    def airflow_params(self, only: tuple[str, ...] | None = None, **defaults: Any) -> dict[str, dict[str, Any]]:
        """JSON-schema keyword sets, one per Param (``only`` these), with defaults from the default variant
        unless given in ``defaults``."""
        flat = self.config().flat()
        cls = self.config_class
        params: dict[str, dict[str, Any]] = {
            "variant": {"default": defaults.get("variant", "default"), "type": "string", "enum": list(VARIANTS),
                        "description": "The recipe's config variant the other Params change: default, demo "
                                       "(what make demo runs) or tiny (seconds of training, for tests)."},
        }
        params |= {name: cls.param_schema(dotted, defaults.get(name, flat[dotted])) for name, dotted in self.form.items()}
        example = next(k for k in flat if k.startswith("model.")) if any(k.startswith("model.") for k in flat) else "train.dropout"
        params["overrides"] = {
            "default": defaults.get("overrides", {}),
            "type": "object",
            "description": f'Any other config field as a dotted key, e.g. {{"{example}": {_json(flat.get(example))}, '
                           f'"evaluate.min_improvement": 0.0}}.',
        }
        return {name: schema for name, schema in params.items() if only is None or name in only}

    def config_from_params(self, params: dict[str, Any]) -> PipelineConfig:
        """The run's config from the triggered Params: the variant, the form's fields, then ``overrides``.

        A Param left at the default variant's value does not replace what another variant sets."""
        variant = params.get("variant") or "default"
        default_flat = self.config().flat()
        overrides = {self.form[name]: value for name, value in params.items()
                     if name in self.form and (variant == "default" or value != default_flat[self.form[name]])}
        overrides.update(params.get("overrides") or {})
        return self.config(variant).with_overrides(overrides)

    def load_train_spec(self):
        """The recipe's heavy part (imports torch)."""
        module, _, attr = self.train_spec.partition(":")
        return getattr(importlib.import_module(module), attr)


def _json(value: Any) -> str:
    import json

    return json.dumps(value)
