"""How config fields are declared and read: ``what_field`` and ``where_field`` (a default, its help, what is
allowed, and whether the field is part of what is made), building a typed config from a mapping with every value
checked, and dotted keys (``flatten``, ``--set KEY=VALUE``). ``pipeline.config`` declares the sections with them."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import field
from typing import Any

from pipeline.errors import ConfigError


# A field's identity (its metadata's ``identity``): WHAT changes what a run makes (the trained model, the dataset
# version), so a run's digest, its checkpoints' resume check and its lineage hash it; WHERE changes only how or
# where the work runs or is watched (paths, worker counts, logging, the gate, the place), which a run may change
# between tries and still resume.
WHAT, WHERE = "what", "where"
IDENTITIES = (WHAT, WHERE)


def what_field(default: Any, help: str, **rules: Any) -> Any:
    """A field that changes what is made: the model trained, or the dataset version prepared."""
    return _field(default, help, WHAT, rules)


def where_field(default: Any, help: str, **rules: Any) -> Any:
    """A field that changes only how or where the work runs or is watched, never what it makes."""
    return _field(default, help, WHERE, rules)


def _field(default: Any, help: str, identity: str, rules: dict[str, Any]) -> Any:
    metadata = {"help": help, "identity": identity, **rules}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def identity_of(cls: type) -> dict[str, Any]:
    """``{field: identity}`` of a config section's fields; a section-typed field maps to its own such dict. A field
    declared without an identity (a plain ``dataclasses.field``) raises: every field must say."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out[f.name] = identity_of(hints[f.name])
        elif f.metadata.get("identity") in IDENTITIES:
            out[f.name] = f.metadata["identity"]
        else:
            raise TypeError(f"{cls.__name__}.{f.name} declares no identity: declare it with what_field (it changes "
                            f"what a run makes) or where_field (only how or where the work runs)")
    return out


def only(values: dict[str, Any], identities: dict[str, Any], identity: str) -> dict[str, Any]:
    """The part of a config's ``asdict`` whose fields have ``identity`` (nested sections kept as dicts)."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        kind = identities.get(name)
        if isinstance(kind, dict):
            section = only(value, kind, identity)
            if section:  # a section with none of them (launch has no what field) is left out
                out[name] = section
        elif kind == identity:
            out[name] = value
    return out


def param_schema(hint: Any, rules: typing.Mapping[str, Any], default: Any) -> dict[str, Any]:
    """JSON-schema keywords for an Airflow ``Param`` mirroring a field's type and rules (min, max, choices)."""
    json_types = {int: "integer", float: "number", str: "string", bool: "boolean"}
    bounds = {"minimum": rules.get("min"), "maximum": rules.get("max")}
    bound_kw = {k: v for k, v in bounds.items() if v is not None}
    if typing.get_origin(hint) is list:
        (item_type,) = typing.get_args(hint)
        items = {"type": json_types[item_type], **bound_kw}
        if "choices" in rules:
            items["enum"] = list(rules["choices"])
        schema = {"type": "array", "items": items, "minItems": 1}
    else:
        schema = {"type": json_types[hint], **bound_kw}
        if "choices" in rules:
            schema["enum"] = list(rules["choices"])
    return {"default": default, "description": rules["help"], **schema}


def flatten(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"depth": 2}}`` -> ``{"model.depth": 2}``, at any depth."""
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def parse_set_args(items: list[str]) -> dict[str, Any]:
    """``["train.lr=3e-4", "train.hidden_sizes=[64,32]"]`` -> dotted overrides (JSON values, else text)."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, for example train.epochs=3")
        try:
            overrides[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key.strip()] = text
    return overrides


def build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__} {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; the keys that exist are {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = build(hint, value, f"{prefix}{name}.")
        else:
            values[name] = _check(f"{prefix}{name}", value, hint, fields[name].metadata)
    return cls(**values)


def _check(name: str, value: Any, hint: Any, rules: typing.Mapping[str, Any]) -> Any:
    origin = typing.get_origin(hint)
    if origin is list:
        (item_type,) = typing.get_args(hint)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{name}={value!r}: expected a list of {item_type.__name__}")
        return [_check(f"{name}[{i}]", item, item_type, rules) for i, item in enumerate(value)]
    value = _coerce(name, value, hint)
    if "choices" in rules and value not in rules["choices"]:
        raise ConfigError(f"{name}={value!r}: expected one of {rules['choices']}")
    if "min" in rules and value < rules["min"]:
        raise ConfigError(f"{name}={value!r}: expected a value >= {rules['min']}")
    if "max" in rules and value > rules["max"]:
        raise ConfigError(f"{name}={value!r}: expected a value <= {rules['max']}")
    return value


def _coerce(name: str, value: Any, hint: Any) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{name}={value!r}: expected {hint.__name__}, got {type(value).__name__}")
