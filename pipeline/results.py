"""What each task hands the next: one small frozen dataclass per result, converted at the XCom boundary.

``to_xcom()`` gives plain JSON values (the shape the Airflow UI shows, with ``mlflow_url`` at the top for
the MLflow button); ``from_xcom(value)`` checks every field and fails with the class, the field and the
value. ``pipeline.airflow.tasks.run_stage`` converts a stage's arguments by their annotations and its
return value, so the stages themselves take and return these types.

Light: standard library only (the DAG processor imports this module, and so do the ranks).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Self

from pipeline.errors import ResultError

__all__ = [
    "ResultError", "Result", "Interval", "PreparedData", "TrainedModel", "RegisteredModel", "ModelScore", "Gate",
    "Evaluation", "Approval", "DatasetSummary", "ModelSummary", "TrainingSummary", "Promotion", "from_xcom_as",
]


class Result:
    """Base of the hand-offs (each a frozen, keyword-only dataclass): checks its fields when built."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            checked = _check(hints[f.name], getattr(self, f.name), f"{type(self).__name__}.{f.name}")
            object.__setattr__(self, f.name, checked)

    def to_xcom(self) -> dict[str, Any]:
        """The result as plain JSON values: nested results as objects, tuples as lists."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_xcom(cls, value: Any) -> Self:
        """The result from its XCom value; a missing, unknown or wrong-typed field raises ``ResultError``."""
        return _from_mapping(cls, value, cls.__name__)


def from_xcom_as(annotation: Any, value: Any, where: str) -> Any:
    """``value`` converted for a parameter annotated ``annotation``: a ``Result`` (or ``Result | None``)
    from its XCom form, an error starting with ``where``; anything else as it is."""
    cls = annotation
    if _is_union(annotation):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None and len(members) < len(typing.get_args(annotation)):
            return None
        cls = members[0] if len(members) == 1 else None
    if not (isinstance(cls, type) and issubclass(cls, Result)):
        return value
    try:
        return cls.from_xcom(value)
    except ResultError as exc:
        raise ResultError(f"{where}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class Interval(Result):
    start: str  # ISO timestamps: [start, end)
    end: str


@dataclass(frozen=True, kw_only=True)
class PreparedData(Result):
    """prepare_data -> train, register_model, evaluate, promote: a dataset version, or a window of them."""

    name: str  # the dataset (its folder under the data root)
    uri: str  # the newest version's
    version: str
    uris: tuple[str, ...]  # every version read, oldest first: a window's, or the one version's
    versions: tuple[str, ...]
    rows: dict[str, int]  # per split, summed over the versions
    bad_rows: int = 0  # rows the validation set aside
    interval: Interval | None = None  # the data interval covered (a per-interval dataset or a window)
    skipped: bool = False  # found already published: nothing was converted
    wall_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class TrainedModel(Result):
    """train (or adopt, for a user's own script) -> register_model, promote."""

    mlflow_run_id: str
    mlflow_experiment_id: str
    mlflow_url: str  # the run's page (the task's MLflow button)
    model_files: dict[str, str]  # what the recipe's package registers: name -> file or folder
    metrics: dict[str, float]  # the last validation's
    world_size: int
    backend: str  # gloo, nccl; or what a script reported
    dataset_version: str
    wall_s: float
    samples_per_s: float | None = None
    baseline_metrics: dict[str, float] | None = None  # the untrained model's, when the recipe measures them
    # The job's metrics file (rank 0's, relayed to MLflow by the train task); register_model sends what is still
    # unsent. None: a script that logged its own.
    metrics_path: str | None = None
    details: dict[str, Any] = field(default_factory=dict)  # the rest of rank 0's result: steps, resumed_from, ...


@dataclass(frozen=True, kw_only=True)
class RegisteredModel(Result):
    """register_model -> evaluate, promote: the version registered for this DAG run, aliased ``challenger``."""

    model_name: str
    version: str
    created: bool  # False: a retry or re-run found the version already registered
    mlflow_run_id: str
    mlflow_experiment_id: str
    mlflow_url: str  # the version's page
    wall_s: float
    phases: dict[str, float] = field(default_factory=dict)  # seconds by phase (open data, model logging, ...)


@dataclass(frozen=True, kw_only=True)
class ModelScore(Result):
    version: str
    metrics: dict[str, float]


@dataclass(frozen=True, kw_only=True)
class Gate(Result):
    """The promotion gate's decision (``pipeline.evaluate.gate.Decision.to_dict()``)."""

    passed: bool
    status: str  # "passed" or "failed"
    reason: str
    primary: dict[str, Any] = field(default_factory=dict)  # the primary metric's numbers
    guardrails: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Evaluation(Result):
    """evaluate -> approve, promote: both models on the same test split, and the gate."""

    challenger: ModelScore
    champion: ModelScore | None  # None: no champion yet, or one that cannot take these inputs
    champion_not_comparable: str | None
    gate: Gate
    test_rows: int
    report: str  # the HTML report's path
    mlflow_url: str  # the report among the run's artifacts
    wall_s: float
    phases: dict[str, float] = field(default_factory=dict)  # seconds by phase (open data, scoring, report, ...)


@dataclass(frozen=True, kw_only=True)
class Approval(Result):
    """approve -> promote: a person's answer, or the operator's own when none is needed (the HITL shape)."""

    chosen_options: tuple[str, ...]
    responded_by_user: str  # the person's name, or why nobody was asked
    responded_at: str | None = None  # ISO timestamp of a person's answer

    @property
    def approved(self) -> bool:
        return self.chosen_options == ("Approve",)


@dataclass(frozen=True, kw_only=True)
class DatasetSummary(Result):
    uri: str
    version: str
    rows: dict[str, int]
    reused: bool


@dataclass(frozen=True, kw_only=True)
class ModelSummary(Result):
    name: str
    version: str
    aliases: tuple[str, ...]
    mlflow_run_id: str


@dataclass(frozen=True, kw_only=True)
class TrainingSummary(Result):
    samples_per_s: float | None
    world_size: int
    backend: str
    final_metrics: dict[str, float]
    baseline_metrics: dict[str, float] | None = None
    cost: dict[str, Any] | None = None  # the run's hours and cost over its attempts (pipeline.job.cost)
    sweep: dict[str, Any] | None = None  # a sweep's best trial, its params and the trials' ends (pipeline.stages.sweep)


@dataclass(frozen=True, kw_only=True)
class Promotion(Result):
    """promote's result and the run's ``summary.json``: what ``make demo`` prints."""

    dag_id: str
    run_id: str
    dataset: DatasetSummary
    model: ModelSummary
    test_metrics: dict[str, float]
    champion_before: ModelScore | None
    gate: Gate
    promoted: bool
    reason: str
    report: str
    train: TrainingSummary
    wall_s: dict[str, float]  # per stage


# -- checking and converting -------------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _from_mapping(cls: type[Result], value: Any, where: str) -> Any:
    if not isinstance(value, Mapping):
        raise ResultError(f"{where}: expected an object with the fields of {cls.__name__}, got {_show(value)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ResultError(f"{where}: unknown field(s) {unknown} in {_show(value)}; {cls.__name__} has {list(fields)}")
    missing = [name for name, f in fields.items() if name not in value
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ResultError(f"{where}: field(s) {missing} missing from {_show(value)}")
    hints = _hints(cls)
    # Checked here too (the constructor checks again), so that an error names the whole path: Evaluation.gate.passed.
    return cls(**{name: _check(hints[name], _parse(hints[name], item, f"{where}.{name}"), f"{where}.{name}")
                  for name, item in value.items()})


def _parse(annotation: Any, value: Any, where: str) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, Result):
        return value if isinstance(value, annotation) else _from_mapping(annotation, value, where)
    if _is_union(annotation):
        if value is None:
            return value  # the constructor's check says whether None is allowed
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _parse(members[0], value, where)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        return [_parse(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict and isinstance(value, Mapping):
        return {k: _parse(args[1], item, f"{where}[{k!r}]") for k, item in value.items()}
    return value


def _check(annotation: Any, value: Any, where: str) -> Any:
    """``value`` if it is of type ``annotation`` (sequences made tuples where the field is one), else raise."""
    if annotation is Any:
        return value
    if _is_union(annotation):
        members = typing.get_args(annotation)
        if value is None and type(None) in members:
            return None
        errors = []
        for member in (m for m in members if m is not type(None)):
            try:
                return _check(member, value, where)
            except ResultError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ResultError(f"{where}: expected {_name(annotation)}, got {_show(value)}")
    if isinstance(annotation, type) and issubclass(annotation, Result):
        if isinstance(value, annotation):
            return value
        raise ResultError(f"{where}: expected a {annotation.__name__}, got {_show(value)}")
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ResultError(f"{where}: expected a list ({_name(annotation)}), got {_show(value)}")
        items = [_check(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ResultError(f"{where}: expected an object ({_name(annotation)}), got {_show(value)}")
        for key in value:
            if not isinstance(key, str):
                raise ResultError(f"{where}: expected string keys, got {_show(key)}")
        return {key: _check(args[1], item, f"{where}[{key!r}]") for key, item in value.items()}
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)  # an int is a float (PEP 484)
    elif annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, annotation)
    if not ok:
        raise ResultError(f"{where}: expected {_name(annotation)}, got {_show(value)}")
    return value


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _plain(value: Any) -> Any:
    if isinstance(value, Result):
        return value.to_xcom()
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _show(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return f"{text if len(text) <= limit else text[:limit] + '...'} ({type(value).__name__})"
