"""Retrieval metrics and the two-tower loss, on cases worked out by hand."""

import math

import pandas as pd
import pytest
import torch

from pipeline.evaluate.retrieval import EVALUATOR, HeldOut, at_k, retrieval_metrics
from pipeline.recipes.two_tower.model import in_batch_softmax_loss


def test_recall_ndcg_and_coverage_by_hand():
    recommended = [["a", "b", "c"] + [f"x{k}" for k in range(60)], ["d", "a"] + [f"y{k}" for k in range(60)]]
    relevant = [{"b", "zz"}, {"y20"}]
    m = retrieval_metrics(recommended, relevant, catalogue_size=100)
    # user 1: b at rank 2 of 2 relevant (zz never shown); user 2: y20 at rank 23 (beyond 10, within 50).
    assert m["recall_at_10"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["recall_at_50"] == pytest.approx((0.5 + 1.0) / 2)
    ideal = 1 + 1 / math.log2(3)
    assert m["ndcg_at_10"] == pytest.approx(((1 / math.log2(3)) / ideal + 0.0) / 2)
    assert m["coverage_at_10"] == pytest.approx(len({"a", "b", "c", "d"} | {f"x{k}" for k in range(7)}
                                                    | {f"y{k}" for k in range(8)}) / 100)


def test_recall_and_ndcg_over_k_by_hand():
    recommended = [["a", "b", "c", "d"] + [f"x{k}" for k in range(60)]]
    relevant = [{"b", "d"}]
    curves = at_k(recommended, relevant, (1, 2, 4, 10))
    assert curves["recall"] == pytest.approx([0.0, 0.5, 1.0, 1.0])
    ideal = 1 + 1 / math.log2(3)  # both relevant items on top
    found = 1 / math.log2(3) + 1 / math.log2(5)  # b at rank 2, d at rank 4
    assert curves["ndcg"] == pytest.approx([0.0, (1 / math.log2(3)) / ideal, found / ideal, found / ideal])
    metrics = retrieval_metrics(recommended, relevant, catalogue_size=100)
    assert (metrics["recall_at_10"], metrics["ndcg_at_10"]) == (curves["recall"][-1], curves["ndcg"][-1])


def test_the_evaluator_scores_the_model_beside_the_popularity_baseline():
    held = HeldOut(relevant=[{"p1"}, {"q"}], popular=["q"] + [f"z{k}" for k in range(60)], catalogue_size=70,
                   interactions=2, oov_users=0, oov_items=1)
    output = pd.DataFrame({"item_ids": [["p1"] + [f"z{k}" for k in range(55)], [f"z{k}" for k in range(56)]]})
    scored = EVALUATOR.score_output(output, held)
    assert scored["metrics"]["recall_at_10"] == 0.5 and scored["details"]["baseline"]["recall_at_10"] == 0.5
    assert not any(name.startswith("popularity_") for name in scored["metrics"])  # the baseline is its own column
    assert scored["details"]["oov_items"] == 1
    with pytest.raises(ValueError, match="fewer than 50 items"):
        EVALUATOR.score_output(pd.DataFrame({"item_ids": [["p1"], ["q"]]}), held)


def test_items_a_user_had_in_training_are_left_out_of_the_model_and_the_baseline_rankings():
    fillers = [f"z{k}" for k in range(55)]
    held = HeldOut(relevant=[{"b"}, {"a"}], popular=["a", "b", *fillers], catalogue_size=60, interactions=2,
                   oov_users=0, oov_items=0, seen=[{"a"}, set()])
    assert held.depth(50) == 51  # what to ask the model for: 50 left after the one item user 0 saw
    output = pd.DataFrame({"item_ids": [["a", "b", *fillers], ["b", "a", *fillers]]})
    scored = EVALUATOR.score_output(output, held)
    # User 0 saw "a": "b" moves up to first; user 1 saw nothing: "a" stays second.
    assert scored["metrics"]["ndcg_at_10"] == pytest.approx((1 + 1 / math.log2(3)) / 2)
    assert scored["details"]["baseline"]["ndcg_at_10"] == 1.0 and scored["details"]["seen_left_out"]
    plain = EVALUATOR.score_output(output, HeldOut(**{**held.__dict__, "seen": None}))
    assert plain["metrics"]["ndcg_at_10"] == pytest.approx(1 / math.log2(3))


def test_in_batch_softmax_masks_accidental_hits_and_applies_log_q():
    users = torch.nn.functional.normalize(torch.randn(4, 8), dim=1)
    items = torch.nn.functional.normalize(torch.randn(4, 8), dim=1)
    distinct = torch.tensor([0, 1, 2, 3])
    plain = in_batch_softmax_loss(users, items, distinct, None, 0.1)
    logits = users @ items.T / 0.1
    assert plain == pytest.approx(torch.nn.functional.cross_entropy(logits, torch.arange(4), reduction="sum").item(), rel=1e-5)

    # Rows 0 and 1 hold the same item: neither is the other's negative.
    repeated = torch.tensor([5, 5, 2, 3])
    masked = logits.clone()
    masked[0, 1] = masked[1, 0] = float("-inf")
    expected = torch.nn.functional.cross_entropy(masked, torch.arange(4), reduction="sum").item()
    assert in_batch_softmax_loss(users, items, repeated, None, 0.1) == pytest.approx(expected, rel=1e-5)

    # log-Q: a popular item's column is lowered by its log-frequency.
    log_q = torch.log(torch.tensor([0.7, 0.1, 0.1, 0.1]))
    corrected = torch.nn.functional.cross_entropy(logits - log_q[None, :], torch.arange(4), reduction="sum").item()
    assert in_batch_softmax_loss(users, items, distinct, log_q, 0.1) == pytest.approx(corrected, rel=1e-5)
