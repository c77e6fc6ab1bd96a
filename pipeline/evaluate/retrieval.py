"""Evaluation of retrieval models: each user's top-k items (the registered model's ``item_ids``) scored
against the items they went on to interact with, next to recommending the training split's most
popular items to everyone. Exact: the model scores the whole catalogue, not a sample of negatives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.evaluate.directions import RETRIEVAL
from pipeline.evaluate.evaluator import predict

BASELINE = "popularity"
KS = (1, 2, 5, 10, 20, 50)  # the report's curves; the model returns at least the largest


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
    seen: list[set[str]] | None = None  # per user, the items of their training rows, left out of every ranking

    def unseen(self, ranked: list[list[str]]) -> list[list[str]]:
        """Each user's ranking without the items they interacted with in training (as is, without ``seen``)."""
        if self.seen is None:
            return ranked
        return [[item for item in items if item not in seen] for items, seen in zip(ranked, self.seen)]

    def depth(self, k: int) -> int:
        """How many items to ask a model for so that ``k`` are left once the user's seen ones are taken out."""
        return k + max((len(seen) for seen in self.seen), default=0) if self.seen is not None else k

    def __len__(self) -> int:
        return len(self.relevant)


def per_user_at_k(recommended: list[list[str]], relevant: list[set[str]],
                  ks: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """recall@k and NDCG@k (binary relevance) of each user (rows) at each k (columns)."""
    depth = max(ks)
    discounts = 1.0 / np.log2(np.arange(2, depth + 2))
    ideal = np.cumsum(discounts)
    recall, ndcg = np.zeros((len(relevant), len(ks))), np.zeros((len(relevant), len(ks)))
    for user, (items, truth) in enumerate(zip(recommended, relevant)):
        hits = np.zeros(depth)
        top = [item in truth for item in items[:depth]]
        hits[:len(top)] = top
        found, gains = np.cumsum(hits), np.cumsum(hits * discounts)
        for column, k in enumerate(ks):
            recall[user, column] = found[k - 1] / len(truth)
            ndcg[user, column] = gains[k - 1] / ideal[min(len(truth), k) - 1]
    return recall, ndcg


def at_k(recommended: list[list[str]], relevant: list[set[str]], ks: tuple[int, ...] = KS) -> dict[str, list]:
    """recall@k and NDCG@k averaged over users, at each of ``ks``: the report's curves."""
    recall, ndcg = per_user_at_k(recommended, relevant, ks)
    return {"k": list(ks), "recall": recall.mean(axis=0).tolist(), "ndcg": ndcg.mean(axis=0).tolist()}


def retrieval_metrics(recommended: list[list[str]], relevant: list[set[str]], catalogue_size: int) -> dict[str, float]:
    """recall@10, recall@50, NDCG@10 averaged over users (the curves' points at 10 and 50), and coverage@10: the
    share of the catalogue in anyone's top 10."""
    recall, ndcg = per_user_at_k(recommended, relevant, (10, 50))
    shown = {item for items in recommended for item in items[:10]}
    return {"recall_at_10": float(recall[:, 0].mean()), "recall_at_50": float(recall[:, 1].mean()),
            "ndcg_at_10": float(ndcg[:, 0].mean()), "coverage_at_10": len(shown) / max(catalogue_size, 1)}


class RetrievalEvaluator:
    metrics = RETRIEVAL
    history_keys = ("train_loss", "val_loss", "step_loss")
    baseline = BASELINE

    def score(self, model_uri: str, inputs, held: HeldOut, cfg=None) -> dict[str, Any]:
        """The registered model's metrics on the users in ``inputs``, beside the popularity baseline's; the model is
        asked for enough items (its ``k`` parameter) to rank ``max(KS)`` once each user's seen ones are left out."""
        k = min(held.depth(max(cfg.model.top_k, max(KS))), held.catalogue_size) if cfg is not None else None
        return self.score_output(predict(model_uri, inputs, params={"k": k} if k else None), held)

    def score_output(self, output, held: HeldOut) -> dict[str, Any]:
        """The model's metrics, with the popularity baseline's in ``details["baseline"]``, and both over k; items a
        user interacted with in training are left out of both rankings when ``held.seen`` says which."""
        recommended = held.unseen([list(items) for items in output["item_ids"]])
        if len(recommended) != len(held):
            raise ValueError(f"the model answered {len(recommended)} users, {len(held)} were asked")
        if min((len(r) for r in recommended), default=50) < max(KS):
            raise ValueError(f"the model returned fewer than {max(KS)} items per user (after the ones each user saw in "
                             f"training); recall@50 needs model.top_k >= 50")
        popular = held.unseen([held.popular] * len(held))
        details = {"users": len(held), "interactions": held.interactions, "catalogue_size": held.catalogue_size,
                   "seen_left_out": held.seen is not None,
                   "oov_users": held.oov_users, "oov_items": held.oov_items,
                   "baseline": retrieval_metrics(popular, held.relevant, held.catalogue_size),
                   "at_k": at_k(recommended, held.relevant), "baseline_at_k": at_k(popular, held.relevant)}
        return {"metrics": retrieval_metrics(recommended, held.relevant, held.catalogue_size), "details": details}

    def report_sections(self, classes: list, scored: dict[str, Any], history) -> list:
        from pipeline.evaluate.report.document import Section, Table, role_labels
        from pipeline.evaluate.report.plots import Panel, Plot, Series, training_curves

        labels = role_labels(scored)
        challenger = scored["challenger"]["details"]
        curves = {role: scored[role]["details"]["at_k"] for role in labels} | {"baseline": challenger["baseline_at_k"]}
        names = labels | {"baseline": f"{BASELINE} (baseline)"}
        panels = []
        for key, title in (("recall", "recall@k"), ("ndcg", "NDCG@k")):
            series = tuple(Series(names[role], role, tuple(c["k"]), tuple(c[key]),
                                  style="dashed" if role == "baseline" else "solid") for role, c in curves.items())
            top = max(y for s in series for y in s.y)
            panels.append(Panel(title, series=series, xlabel="k (items recommended)", ylabel=title, xscale="log",
                                xticks=tuple(map(float, KS)), xlim=(0.8, max(KS) * 1.25),
                                ylim=(0.0, min(1.0, top * 1.15) if top > 0 else 1.0)))
        table = Table(("k", *(names[r] for r in curves), *(names[r] for r in curves)),
                      tuple((k, *(c["recall"][i] for c in curves.values()), *(c["ndcg"][i] for c in curves.values()))
                            for i, k in enumerate(KS)), groups=(("", 1, ""), ("recall@k", len(curves), ""),
                                                                 ("NDCG@k", len(curves), "")))
        d = challenger
        facts = (f"{d['users']} users with {d['interactions']} held-out interactions; a catalogue of "
                 f"{d['catalogue_size']} items; out of vocabulary: {d['oov_users']} users, {d['oov_items']} "
                 f"interactions with items unseen in training. The {BASELINE} baseline recommends the training "
                 f"split's most interacted-with items to everyone."
                 + (" Every ranking leaves out the items the user interacted with in training."
                    if d.get("seen_left_out") else ""))
        sections = [Section("Retrieval over k", (facts, Plot("retrieval_at_k", "Recall and NDCG over k", tuple(panels)),
                                                 table))]
        training = training_curves(history, labels)
        if training is not None:
            sections.append(Section("Training", (training,)))
        return sections


EVALUATOR = RetrievalEvaluator()
