"""The report as one self-contained HTML page: the gate's verdict first, the key figures, then the recipe's
sections; one stylesheet and the plots inlined, so it opens alike from disk and from MLflow's artifact view."""

from __future__ import annotations

import base64
from html import escape
from pathlib import Path
from typing import Any, Mapping

from pipeline.evaluate.report.document import Report, Samples, Section, Table
from pipeline.evaluate.report.figures import PREFIXES, KeyFigures
from pipeline.evaluate.report.plots import Plot

STYLESHEET = Path(__file__).with_name("style.css")


def render(report: Report, images: Mapping[str, bytes]) -> str:
    """The page; ``images`` holds each plot's PNG by the plot's name."""
    challenger = report.figures.columns[0].label
    champion = report.figures.column("champion")
    versus = f"{challenger} vs {champion.label}" if champion else f"{challenger} (no champion to compare)"
    body = [
        _verdict(report.decision),
        f"<h1>{escape(report.model_name)}: {escape(versus)}</h1>",
        "<ul class=\"facts\">" + "".join(f"<li>{escape(f)}</li>" for f in report.facts) + "</ul>",
        _gate_checks(report.decision, report.figures),
        "<section id=\"key-figures\"><h2>Key figures</h2>" + _key_figures(report.figures) + "</section>",
        *(_section(s, images) for s in report.sections),
    ]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(report.model_name)} evaluation</title>
<style>
{STYLESHEET.read_text()}</style>
</head><body><main>
{chr(10).join(part for part in body if part)}
</main></body></html>
"""


def _verdict(decision: Mapping[str, Any]) -> str:
    status = str(decision["status"])
    return (f"<p class=\"verdict {escape(status)}\" id=\"verdict\"><strong>Gate {escape(status)}</strong> "
            f"{escape(str(decision['reason']))}</p>")


def _gate_checks(decision: Mapping[str, Any], figures: KeyFigures) -> str:
    """The gate's comparisons: the primary metric's gain and each guardrail's change against what is allowed."""
    primary = decision.get("primary") or {}
    if "champion" not in primary:
        return ""
    checks = [("primary", primary["metric"], primary["challenger"], primary["champion"], primary["improvement"],
               f">= {primary['min_improvement']:+.4f}", primary["improvement"] >= primary["min_improvement"])]
    checks += [("guardrail", g["metric"], g["challenger"], g["champion"], -g["regression"],
                f">= {-g['tolerance']:+.4f}", g["held"]) for g in decision.get("guardrails", ())]
    rows = "".join(
        f"<tr><td>{kind}</td><td>{escape(metric)}</td>{_num(ours)}{_num(theirs)}"
        f"<td class=\"num {'better' if ok else 'worse'}\">{gain:+.4f}</td><td>{escape(allowed)}</td>"
        f"<td class=\"{'better' if ok else 'worse'}\">{'pass' if ok else 'fail'}</td></tr>"
        for kind, metric, ours, theirs, gain, allowed, ok in checks)
    labels = [figures.columns[0].label, figures.column("champion").label]
    return ("<section id=\"gate\"><h2>Gate checks</h2><table><tr><th>check</th><th>metric</th>"
            + "".join(f"<th class=\"{role}\">{escape(label)}</th>"
                      for role, label in zip(("challenger", "champion"), labels))
            + "<th>gain</th><th>required gain</th><th>result</th></tr>" + rows + "</table></section>")


def _key_figures(figures: KeyFigures) -> str:
    """Each figure's cell carries its MLflow metric name and exact value: the same numbers the run logs."""
    champion = figures.column("champion") is not None
    header = ("<tr><th>metric</th><th>better</th>" + "".join(
        f"<th class=\"{c.role}\">{escape(c.label)}</th>" for c in figures.columns)
        + ("<th>change vs champion</th>" if champion else "") + "</tr>")
    rows = []
    for name in figures.names:
        cells = [f"<td>{escape(name)}</td>",
                 f"<td>{'' if name not in figures.directions else 'higher' if figures.directions[name] else 'lower'}</td>"]
        for c in figures.columns:
            value = figures.value(c.role, name)
            attributes = ("" if value is None
                          else f" data-mlflow=\"{PREFIXES[c.role]}{escape(name)}\" data-value=\"{value!r}\"")
            cells.append(f"<td class=\"num\"{attributes}>{figures.format(name, value)}</td>")
        if champion:  # of the metrics the gate compares; the other figures (counts) need none
            change, better = figures.change(name), figures.better(name)
            mark = "" if better is None else " better" if better else " worse"
            shown = "" if name not in figures.directions else "n/a" if change is None else f"{change:+.4f}"
            cells.append(f"<td class=\"num{mark}\">{shown}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return "<table class=\"figures\">" + header + "".join(rows) + "</table>"


def _section(section: Section, images: Mapping[str, bytes]) -> str:
    anchor = "-".join(section.title.lower().split())
    parts = [f"<section id=\"{escape(anchor)}\"><h2>{escape(section.title)}</h2>"]
    for item in section.items:
        if isinstance(item, str):
            parts.append(f"<p>{escape(item)}</p>")
        elif isinstance(item, Table):
            parts.append(_table(item))
        elif isinstance(item, Plot):
            data = base64.b64encode(images[item.name]).decode()
            parts.append(f"<figure id=\"plot-{escape(item.name)}\"><img alt=\"{escape(item.title)}\" "
                         f"src=\"data:image/png;base64,{data}\"></figure>")
        elif isinstance(item, Samples):
            parts.append(_samples(item))
    return "".join(parts) + "</section>"


def _table(table: Table) -> str:
    caption = f"<caption>{escape(table.caption)}</caption>" if table.caption else ""
    groups = "".join(f"<th colspan=\"{span}\" class=\"{role}\">{escape(label)}</th>"
                     for label, span, role in table.groups)
    header = ((f"<tr>{groups}</tr>" if groups else "")
              + "<tr>" + "".join(f"<th>{escape(c)}</th>" for c in table.columns) + "</tr>")
    rows = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in table.rows)
    return f"<table>{caption}{header}{rows}</table>"


def _cell(value: Any) -> str:
    if value is None:
        return "<td class=\"num\">n/a</td>"
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, int):
        return f"<td class=\"num\">{value}</td>"
    return f"<td>{escape(str(value))}</td>"


def _num(value: float) -> str:
    return f"<td class=\"num\">{value:.4f}</td>"


def _samples(samples: Samples) -> str:
    header = ("<tr><th>prompt</th><th>reference</th>"
              + "".join(f"<th class=\"{role}\">{escape(label)}</th>" for role, label in samples.labels.items()) + "</tr>")
    rows = []
    for sample in samples.rows:
        cells = [f"<td><pre>{escape(sample.prompt)}</pre></td>", f"<td><pre>{escape(sample.reference)}</pre></td>"]
        for role in samples.labels:
            if role not in sample.generated:
                cells.append("<td>n/a</td>")
                continue
            ok = sample.matches(role)
            marked = "".join(escape(text) if kind == "same" else f"<mark>{escape(text)}</mark>" if kind == "extra"
                             else f"<del>{escape(text)}</del>" for kind, text in sample.diff(role))
            cells.append(f"<td class=\"{'match' if ok else 'mismatch'}\"><pre><span class=\"tick\">{'✓' if ok else '✗'}"
                         f"</span>{marked}</pre></td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    caption = f"<caption>{escape(samples.caption)}</caption>"
    return f"<table class=\"samples\">{caption}{header}{''.join(rows)}</table>"
