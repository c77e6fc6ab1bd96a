"""The key figures: each model's test metrics in one table, the single source of the report's first table, the
task log's summary and the run's MLflow metrics, so that the MLflow UI's charts and the report never disagree."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

# The MLflow metric name of a figure is its column's prefix and the metric's name: test_accuracy,
# champion_test_accuracy, baseline_test_accuracy (what a recipe's ``baseline`` hook logs during training).
PREFIXES = {"challenger": "test_", "champion": "champion_test_", "baseline": "baseline_test_"}


@dataclass(frozen=True)
class Column:
    role: str  # challenger, champion or baseline
    label: str  # what the table's header says: "challenger v3", "popularity (baseline)"
    values: Mapping[str, float]


@dataclass(frozen=True)
class KeyFigures:
    names: tuple[str, ...]  # the rows: the gate's metrics first, then the challenger's other figures
    directions: Mapping[str, bool]  # metric -> higher is better, for the metrics the gate may compare
    columns: tuple[Column, ...]  # challenger first, then champion and baseline where there are

    @classmethod
    def of(cls, directions: Mapping[str, bool], columns: list[Column]) -> KeyFigures:
        challenger = columns[0].values
        names = [n for n in directions if n in challenger] + [n for n in challenger if n not in directions]
        return cls(tuple(names), dict(directions), tuple(columns))

    def column(self, role: str) -> Column | None:
        return next((c for c in self.columns if c.role == role), None)

    def value(self, role: str, name: str) -> float | None:
        """A finite figure, or None when that column has none for ``name``."""
        column = self.column(role)
        value = None if column is None else column.values.get(name)
        return float(value) if value is not None and math.isfinite(value) else None

    def change(self, name: str) -> float | None:
        """Challenger minus champion, when both have the figure."""
        ours, theirs = self.value("challenger", name), self.value("champion", name)
        return None if ours is None or theirs is None else ours - theirs

    def better(self, name: str) -> bool | None:
        """Whether the challenger beats the champion on ``name`` (None: no direction, no champion or a tie)."""
        change = self.change(name)
        if name not in self.directions or not change:
            return None
        return (change > 0) == self.directions[name]

    def mlflow_metrics(self) -> dict[str, float]:
        """Every figure under its MLflow name (what the evaluate stage logs to the challenger's run)."""
        return {PREFIXES[c.role] + name: v for c in self.columns for name in self.names
                if (v := self.value(c.role, name)) is not None}

    def format(self, name: str, value: float | None) -> str:
        """How the report and the task log show a figure: counts whole, metrics with 4 decimals."""
        if value is None:
            return "n/a"
        if name not in self.directions and float(value).is_integer():
            return str(int(value))
        return f"{value:.4f}"

    def text(self) -> str:
        width = max(20, *(len(c.label) + 2 for c in self.columns))
        lines = ["metric".ljust(16) + "".join(c.label.rjust(width) for c in self.columns)]
        for name in self.names:
            lines.append(name.ljust(16) + "".join(self.format(name, self.value(c.role, name)).rjust(width)
                                                  for c in self.columns))
        return "\n".join(lines)
