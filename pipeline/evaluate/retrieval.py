"""Evaluation of retrieval models: each user's top-k items (the registered model's ``item_ids``) scored
against the items they went on to interact with, next to recommending the training split's most
popular items to everyone. Exact: the model scores the whole catalogue, not a sample of negatives."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.evaluate.directions import RETRIEVAL
from pipeline.evaluate.evaluator import predict

BASELINE = "popularity"


@dataclass
class HeldOut:
    """What the evaluated users did: per user (in the inputs' order) the held-out items; the baseline's
    ranking; the catalogue's size; and what the training vocabularies did not know."""

    relevant: list[set[str]]
    popular: list[str]  # the training split's most interacted-with items, most first
    catalogue_size: int
    interactions: int
    oov_users: int  # held-out users never seen in training: scored through the unknown-user embedding
    oov_items: int  # held-out interactions with items never seen in training: no model can retrieve them

    def __len__(self) -> int:
        return len(self.relevant)


def retrieval_metrics(recommended: list[list[str]], relevant: list[set[str]], catalogue_size: int) -> dict[str, float]:
    """recall@10, recall@50, NDCG@10 (binary relevance) averaged over users, and coverage@10: the share
    of the catalogue in anyone's top 10."""
    recall10, recall50, ndcg10 = [], [], []
    shown: set[str] = set()
    discounts = 1.0 / np.log2(np.arange(2, 12))
    for items, truth in zip(recommended, relevant):
        hits = np.array([item in truth for item in items[:50]], dtype=bool)
        recall10.append(hits[:10].sum() / len(truth))
        recall50.append(hits[:50].sum() / len(truth))
        ideal = discounts[:min(len(truth), 10)].sum()
        ndcg10.append(float((hits[:10] * discounts[:len(hits[:10])]).sum() / ideal))
        shown.update(items[:10])
    return {"recall_at_10": float(np.mean(recall10)), "recall_at_50": float(np.mean(recall50)),
            "ndcg_at_10": float(np.mean(ndcg10)), "coverage_at_10": len(shown) / max(catalogue_size, 1)}


class RetrievalEvaluator:
    metrics = RETRIEVAL
    history_keys = ("train_loss", "val_loss", "step_loss")

    def score(self, model_uri: str, inputs, held: HeldOut, cfg=None) -> dict[str, Any]:
        """The registered model's metrics on the users in ``inputs``, beside the popularity baseline's."""
        return self.score_output(predict(model_uri, inputs), held)

    def score_output(self, output, held: HeldOut) -> dict[str, Any]:
        """The model's metrics, with the popularity baseline's beside them as ``popularity_<metric>``."""
        recommended = [list(items) for items in output["item_ids"]]
        if len(recommended) != len(held):
            raise ValueError(f"the model answered {len(recommended)} users, {len(held)} were asked")
        if min((len(r) for r in recommended), default=50) < 50:
            raise ValueError("the model returned fewer than 50 items per user; recall@50 needs model.top_k >= 50")
        model = retrieval_metrics(recommended, held.relevant, held.catalogue_size)
        baseline = retrieval_metrics([held.popular] * len(held), held.relevant, held.catalogue_size)
        details = {"users": len(held), "interactions": held.interactions, "catalogue_size": held.catalogue_size,
                   "oov_users": held.oov_users, "oov_items": held.oov_items, "baseline": baseline}
        return {"metrics": model | {f"{BASELINE}_{k}": v for k, v in baseline.items()}, "details": details}

    def write_report(self, out_dir: Path, *, model_name: str, classes: list, scored: dict[str, Any],
                     history: dict[str, list[tuple[int, float]]], decision: dict[str, Any]) -> list[Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        present = {role: s for role, s in scored.items() if s is not None}
        challenger = present["challenger"]
        columns = [(f"{role} v{s['version']}", s["metrics"]) for role, s in present.items()]
        columns.append((f"{BASELINE} (training split)", challenger["details"]["baseline"]))
        esc = html.escape
        header = "".join(f"<th>{esc(name)}</th>" for name, _ in columns)
        rows = "".join(f"<tr><td>{key}</td>" + "".join(f"<td>{values[key]:.4f}</td>" for _, values in columns) + "</tr>"
                       for key in RETRIEVAL)
        d = challenger["details"]
        facts = (f"{d['users']} users with {d['interactions']} held-out interactions; catalogue of "
                 f"{d['catalogue_size']} items; out of vocabulary: {d['oov_users']} users, {d['oov_items']} "
                 f"interactions with unseen items.")
        curve = "".join(f"<tr><td>{step}</td><td>{value:.4f}</td></tr>" for step, value in history.get("val_loss", []))
        page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{esc(model_name)} evaluation</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{border:1px solid #ccc;padding:4px 8px}}table{{border-collapse:collapse}}</style>
</head><body>
<h1>{esc(model_name)}: retrieval on held-out interactions</h1>
<p>{esc(facts)}</p>
<table><tr><th>metric</th>{header}</tr>{rows}</table>
<h2>Gate</h2><p><b>{esc(decision['status'])}</b>: {esc(decision['reason'])}</p>
<h2>Validation loss</h2><table><tr><th>step</th><th>val_loss</th></tr>{curve}</table>
</body></html>
"""
        report = out_dir / "report.html"
        report.write_text(page)
        summary = out_dir / "metrics.json"
        summary.write_text(json.dumps({name: values for name, values in columns} | {"details": d}, indent=2))
        return [report, summary]

    def text_summary(self, classes: list, scored: dict[str, Any], decision: dict[str, Any]) -> str:
        present = {role: s for role, s in scored.items() if s is not None}
        baseline = present["challenger"]["details"]["baseline"]
        names = [f"{role} v{s['version']}" for role, s in present.items()] + [BASELINE]
        lines = ["metric          " + "".join(f"{n:>20}" for n in names)]
        for key in RETRIEVAL:
            lines.append(f"{key:<16}" + "".join(f"{s['metrics'][key]:>20.4f}" for s in present.values())
                         + f"{baseline[key]:>20.4f}")
        d = present["challenger"]["details"]
        lines.append(f"users {d['users']}, out of vocabulary: {d['oov_users']} users, {d['oov_items']} interactions")
        lines.append(f"gate: {decision['status']}: {decision['reason']}")
        return "\n".join(lines)


EVALUATOR = RetrievalEvaluator()
