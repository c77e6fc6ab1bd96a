"""A sweep's search space: ranges and choices over a recipe's ``model.*`` and ``train.*`` config fields, each
checked against the field's own rules (type, min, max, choices), so a space that names an unknown field or an
impossible range fails before any trial starts.

The form is JSON, one entry per dotted field::

    {"train.learning_rate": {"low": 1e-4, "high": 1e-2, "log": true},
     "train.batch_size": {"low": 32, "high": 256, "step": 32},
     "model.hidden_sizes": {"choices": [[64, 32], [128, 64]]}}

A range is for an int or float field (``log`` samples its logarithm evenly, ``step`` a grid from ``low``); choices
are for any field. The trials of a sweep share one prepared dataset and one launch, so ``data.*``, ``launch.*``,
``registry.*`` and ``evaluate.*`` fields are not searched. Standard library only: Optuna is imported where the
study is (``pipeline.sweep.study``).
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.errors import ConfigError

SEARCHED_SECTIONS = ("model.", "train.")
RANGE_KEYS, CHOICE_KEYS = {"low", "high", "log", "step"}, {"choices"}


@dataclass(frozen=True)
class Dimension:
    """One searched field: a range (``low``..``high``, ``log``, ``step``) or ``choices``."""

    field: str
    kind: Any  # int, float, or the field's type for choices (list[int]...)
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()

    def suggest(self, trial) -> Any:
        """Ask ``trial`` (an ``optuna.Trial``) for this field's value, through Optuna's public suggest API (list choices
        travel as JSON text: Optuna's choices are scalars)."""
        if self.choices:
            return trial.suggest_categorical(self.field, [_encode(c) for c in self.choices])
        if self.kind is int:
            return trial.suggest_int(self.field, int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return trial.suggest_float(self.field, self.low, self.high, log=self.log, step=self.step)

    def value(self, sampled: Any) -> Any:
        """The config value of what the study sampled for this field."""
        return json.loads(sampled) if self.choices and typing.get_origin(self.kind) is list else sampled


@dataclass(frozen=True)
class SearchSpace:
    dimensions: tuple[Dimension, ...]

    @classmethod
    def parse(cls, raw: Any, base: PipelineConfig, *, where: str = "search_space") -> "SearchSpace":
        """The space ``raw`` (the Param's JSON) checked against ``base``'s fields; a ``ConfigError`` names the
        field, the value and what was expected."""
        if not isinstance(raw, dict) or not raw:
            raise ConfigError(f"{where}={raw!r}: expected a non-empty mapping of dotted config fields to "
                              f'ranges or choices, e.g. {{"train.learning_rate": {{"low": 1e-4, "high": 1e-2, "log": true}}}}')
        searchable = searchable_fields(base)
        return cls(tuple(_dimension(f"{where}[{name!r}]", name, spec, base, searchable) for name, spec in raw.items()))

    def overrides(self, sampled: dict[str, Any]) -> dict[str, Any]:
        """The dotted config overrides of a trial's sampled params."""
        return {d.field: d.value(sampled[d.field]) for d in self.dimensions if d.field in sampled}

    def encode(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """A point of the space (dotted field -> config value) as the study's params (``enqueue``)."""
        return {name: _encode(value) if not isinstance(value, (int, float, str, bool)) else value
                for name, value in overrides.items()}


def searchable_fields(base: PipelineConfig) -> list[str]:
    return sorted(key for key in base.flat() if key.startswith(SEARCHED_SECTIONS))


def check_point(point: Any, space: SearchSpace, base: PipelineConfig, where: str) -> dict[str, Any]:
    """A point to try first (``enqueue``): fields of the space only, values the fields accept."""
    if not isinstance(point, dict) or not point:
        raise ConfigError(f"{where}={point!r}: expected a mapping of searched fields to values")
    fields = {d.field for d in space.dimensions}
    unknown = sorted(set(point) - fields)
    if unknown:
        raise ConfigError(f"{where}: field(s) {unknown} are not in the search space; expected some of {sorted(fields)}")
    base.with_overrides(point)  # each value passes its field's rules
    return point


def _dimension(where: str, name: str, spec: Any, base: PipelineConfig, searchable: list[str]) -> Dimension:
    if name not in searchable:
        reason = ("the trials share one prepared dataset and one launch, so only model.* and train.* fields are "
                  "searched" if name in base.flat() else "no such config field")
        raise ConfigError(f"{where}: {reason}; expected one of {searchable}")
    if not isinstance(spec, dict) or not spec or not (set(spec) <= RANGE_KEYS or set(spec) <= CHOICE_KEYS):
        raise ConfigError(f"{where}={spec!r}: expected a range {{\"low\": ..., \"high\": ...}} (with \"log\" or "
                          f"\"step\" if wanted) or {{\"choices\": [...]}}")
    hint, rules = type(base).field_rules(name)
    if "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}.choices={choices!r}: expected a non-empty list of values")
        for i, choice in enumerate(choices):
            try:
                base.with_overrides({name: choice})
            except ConfigError as exc:
                raise ConfigError(f"{where}.choices[{i}]: {exc}") from None
        return Dimension(name, hint, choices=tuple(choices))
    if hint not in (int, float):
        raise ConfigError(f"{where}: {name} is a {getattr(hint, '__name__', hint)} field; a range needs an int or "
                          f"float field, give it {{\"choices\": [...]}}")
    missing = sorted({"low", "high"} - set(spec))
    if missing:
        raise ConfigError(f"{where}={spec!r}: missing {missing}; a range needs both low and high")
    low, high, log, step = spec["low"], spec["high"], spec.get("log", False), spec.get("step")
    for key, value in (("low", low), ("high", high)) + ((("step", step),) if step is not None else ()):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}.{key}={value!r}: expected a number")
        if hint is int and float(value) != int(value):
            raise ConfigError(f"{where}.{key}={value!r}: {name} is an int field; expected a whole number")
    if not isinstance(log, bool):
        raise ConfigError(f"{where}.log={log!r}: expected true or false")
    if not low < high:
        raise ConfigError(f"{where}: low={low!r} is not below high={high!r}; expected low < high")
    for key, value in (("low", low), ("high", high)):
        if "min" in rules and value < rules["min"]:
            raise ConfigError(f"{where}.{key}={value!r}: {name} must be >= {rules['min']}")
        if "max" in rules and value > rules["max"]:
            raise ConfigError(f"{where}.{key}={value!r}: {name} must be <= {rules['max']}")
    if log and low <= 0:
        raise ConfigError(f"{where}: log=true needs low > 0, got low={low!r}")
    if step is not None and (step <= 0 or step > high - low or (log and hint is float)):
        raise ConfigError(f"{where}.step={step!r}: expected 0 < step <= high - low ({high - low:g}), and no step "
                          f"with log on a float field")
    if log and step not in (None, 1):
        raise ConfigError(f"{where}.step={step!r}: a log range of an int field samples every integer (step 1)")
    return Dimension(name, hint, low=hint(low), high=hint(high), log=log, step=None if step is None else hint(step))


def param_schema(base: PipelineConfig) -> dict[str, Any]:
    """JSON-schema keywords of the ``search_space`` Param: its keys must be searchable fields, each value a range or
    choices, and a numeric field's bounds and choices within its min and max, so the trigger form and the REST API
    refuse those before a run exists (the rest, low < high and each choice's other rules, is checked by
    ``SearchSpace.parse`` in the sweep's first task)."""
    number = {"type": "number"}
    entry = {"oneOf": [
        {"type": "object", "required": ["low", "high"], "additionalProperties": False,
         "properties": {"low": number, "high": number, "log": {"type": "boolean"}, "step": number}},
        {"type": "object", "required": ["choices"], "additionalProperties": False,
         "properties": {"choices": {"type": "array", "minItems": 1}}},
    ]}
    fields = searchable_fields(base)
    bounded = {}
    for name in fields:
        hint, rules = type(base).field_rules(name)
        limits = {key: rules[rule] for key, rule in (("minimum", "min"), ("maximum", "max")) if rule in rules}
        if hint in (int, float) and limits:
            within = {"type": "number", **limits}
            bounded[name] = {"allOf": [entry, {"properties": {"low": within, "high": within,
                                                              "choices": {"items": within}}}]}
    return {"type": "object", "minProperties": 1, "propertyNames": {"enum": fields}, "properties": bounded,
            "additionalProperties": entry}


def _encode(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, dict)) else value
