"""What a report is made of: the gate's verdict, the key figures and the sections a recipe's evaluator supplies
(tables, plots, sample generations), as plain data that the page, the task log and the tests read."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Mapping

from pipeline.evaluate.report.figures import KeyFigures
from pipeline.evaluate.report.plots import Plot

# The models a report compares, in the order every table and plot shows them.
ROLES = ("challenger", "champion")
# Each model's run history, as the report plots it: role -> metric -> [(step, value)].
History = Mapping[str, Mapping[str, list[tuple[int, float]]]]


def role_labels(scored: Mapping[str, Mapping[str, Any] | None]) -> dict[str, str]:
    """``{role: "challenger v3"}`` for the models that were scored, challenger first."""
    return {role: f"{role} v{scored[role]['version']}" for role in ROLES if scored.get(role) is not None}


@dataclass(frozen=True)
class Table:
    """Cells are text, numbers (floats shown with 4 decimals) or None (not available)."""

    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    caption: str = ""
    # A header row above the columns: (label, columns spanned, role or "") each, e.g. a model over its columns.
    groups: tuple[tuple[str, int, str], ...] = ()


@dataclass(frozen=True)
class Sample:
    """One prompt, its reference and what each model generated for it (by role)."""

    prompt: str
    reference: str
    generated: Mapping[str, str]

    def matches(self, role: str) -> bool:
        """Exact match as the language-model evaluator counts it: surrounding whitespace ignored."""
        return self.generated[role].strip() == self.reference.strip()

    def diff(self, role: str) -> list[tuple[str, str]]:
        """The generation against the reference, word by word, as ``(kind, text)``: ``same``, ``extra`` (generated,
        not in the reference) or ``missing`` (in the reference, not generated)."""
        ours, theirs = _words(self.generated[role].strip()), _words(self.reference.strip())
        out = []
        for op, a, b, c, d in difflib.SequenceMatcher(None, ours, theirs, autojunk=False).get_opcodes():
            if op == "equal":
                out.append(("same", "".join(ours[a:b])))
                continue
            if b > a:
                out.append(("extra", "".join(ours[a:b])))
            if d > c:
                out.append(("missing", "".join(theirs[c:d])))
        return out


def _words(text: str) -> list[str]:
    return re.findall(r"\s+|\w+|[^\w\s]", text)


@dataclass(frozen=True)
class Samples:
    caption: str
    labels: Mapping[str, str]  # role -> the model's column header, challenger first
    rows: tuple[Sample, ...]


@dataclass(frozen=True)
class Section:
    title: str
    items: tuple[Table | Plot | Samples | str, ...]  # a str is a paragraph


@dataclass(frozen=True)
class Report:
    model_name: str
    decision: Mapping[str, Any]  # ``pipeline.evaluate.gate.Decision.to_dict()``
    figures: KeyFigures
    facts: tuple[str, ...]  # one line each: what was evaluated (split, rows, dataset version)
    sections: tuple[Section, ...]

    def plots(self) -> list[Plot]:
        return [item for section in self.sections for item in section.items if isinstance(item, Plot)]

    def plot(self, name: str) -> Plot:
        found = [p for p in self.plots() if p.name == name]
        if not found:
            raise KeyError(f"no plot {name!r}; the report has {[p.name for p in self.plots()]}")
        return found[0]

    def text(self) -> str:
        """A compact text version for the task log: the key figures, the facts and the gate's verdict."""
        return "\n".join([self.figures.text(), *self.facts,
                          f"gate: {self.decision['status']}: {self.decision['reason']}"])
