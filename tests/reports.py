"""Small synthetic evaluation results of every recipe, built into reports the way the evaluate stage builds
them (the recipe's evaluator scores synthetic model output, the gate decides, ``build_report`` assembles),
for the report's tests; no model is trained and no DAG runs."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pandas as pd

from pipeline.evaluate.report import build_report
from pipeline.evaluate.report.document import Report

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
ADJECTIVES = ["long-tailed", "spotted", "northern", "lesser", "giant", "common", "striped", "pale", "royal", "dusky"]
NOUNS = ["mountain salamander", "river otter", "grey heron", "desert fox", "garden snail", "harbour seal",
         "forest owl", "sea turtle", "field mouse", "tree frog"]


def history(steps: list[int], *, loss_start: float, accuracy: bool, seed: int) -> dict[str, list[tuple[int, float]]]:
    """One run's curves: losses falling from ``loss_start`` (validation above training), and accuracies rising."""
    rng = np.random.default_rng(seed)
    fall = np.linspace(1.0, 0.35, len(steps))
    curves = {"train_loss": [(s, float(loss_start * f * 0.8 + rng.uniform(0, 0.05))) for s, f in zip(steps, fall)],
              "val_loss": [(s, float(loss_start * f + rng.uniform(0, 0.05))) for s, f in zip(steps, fall)]}
    if accuracy:
        rise = np.linspace(0.3, 0.9, len(steps))
        curves |= {"train_accuracy": [(s, float(r + 0.03)) for s, r in zip(steps, rise)],
                   "val_accuracy": [(s, float(r)) for s, r in zip(steps, rise)]}
    return curves


def classifier_output(labels: np.ndarray, num_classes: int, skill: float, seed: int) -> pd.DataFrame:
    """``proba_<k>`` columns of a model that is right with a margin ``skill`` and mostly confuses neighbours."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1, (len(labels), num_classes))
    logits[np.arange(len(labels)), labels] += skill
    logits[np.arange(len(labels)), (labels + 1) % num_classes] += skill * 0.6
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return pd.DataFrame({f"proba_{k}": probabilities[:, k] for k in range(num_classes)})


def _decide(recipe: str, evaluator, scored) -> dict[str, Any]:
    from pipeline.evaluate.gate import decide
    from pipeline.recipes import get_recipe

    champion = scored.get("champion")
    cfg = get_recipe(recipe).config("tiny").evaluate
    return decide(cfg, scored["challenger"]["metrics"], champion["metrics"] if champion else None,
                  evaluator.metrics).to_dict()


def classification(recipe: str, classes: list[str], rows: int, steps: list[int],
                   champion_skill: float | None = 2.0) -> dict:
    """Labels skewed towards the first classes; a challenger of skill 3 and a champion of ``champion_skill``."""
    from pipeline.evaluate.classification import EVALUATOR

    rng = np.random.default_rng(len(classes))
    weights = np.linspace(2, 1, len(classes))
    labels = rng.choice(len(classes), rows, p=weights / weights.sum())
    output = classifier_output(labels, len(classes), 3.0, 1)
    scored = {"challenger": {"version": "3", **EVALUATOR.score_output(output, labels)}, "champion": None}
    runs = {"challenger": history(steps, loss_start=5.5, accuracy=True, seed=1)}
    if champion_skill is not None:
        output = classifier_output(labels, len(classes), champion_skill, 2)
        scored["champion"] = {"version": "2", **EVALUATOR.score_output(output, labels)}
        runs["champion"] = history(steps, loss_start=6.0, accuracy=True, seed=2)
    return dict(evaluator=EVALUATOR, classes=classes, scored=scored, history=runs,
                decision=_decide(recipe, EVALUATOR, scored))


def tabular_mlp() -> dict:
    """Ten classes named by words, from a two-epoch run (two points per curve)."""
    return classification("tabular_mlp", [WORDS[k] for k in (8, 5, 4, 9, 0, 1, 2, 3, 6, 7)], 600, [19, 38])


def tabular_mlp_binary() -> dict:
    """Two classes: ROC and precision-recall; no champion yet."""
    return classification("tabular_mlp", ["no", "yes"], 400, [10, 20, 30], champion_skill=None)


def image_classifier() -> dict:
    """A hundred classes with long names of several words, from a 20-epoch run; the champion is better (the gate
    fails)."""
    names = [f"{ADJECTIVES[k // 10]} {NOUNS[k % 10]}" for k in range(100)]
    return classification("image_classifier", names, 3000, list(range(50, 1001, 50)), champion_skill=3.4)


def two_tower() -> dict:
    """Users whose held-out items the challenger ranks higher than the champion; popularity far behind."""
    from pipeline.evaluate.retrieval import EVALUATOR, HeldOut

    rng = np.random.default_rng(0)
    catalogue = [f"i{k:04d}" for k in range(400)]
    relevant = [set(rng.choice(catalogue, 2, replace=False)) for _ in range(200)]
    held = HeldOut(relevant=relevant, popular=catalogue[:100], catalogue_size=len(catalogue), interactions=400,
                   oov_users=3, oov_items=5)

    def output(spread: int, seed: int) -> pd.DataFrame:
        local = np.random.default_rng(seed)
        lists = []
        for truth in relevant:
            items = [i for i in local.permutation(catalogue)[:100] if i not in truth]
            for item in truth:
                items.insert(int(local.integers(0, spread)), item)
            lists.append(items[:100])
        return pd.DataFrame({"item_ids": lists})

    scored = {"challenger": {"version": "3", **EVALUATOR.score_output(output(20, 1), held)},
              "champion": {"version": "2", **EVALUATOR.score_output(output(60, 2), held)}}
    steps = list(range(10, 81, 10))
    runs = {role: history(steps, loss_start=4.0, accuracy=False, seed=n) for n, role in enumerate(scored)}
    runs["challenger"]["step_loss"] = [(s, 4.0 - s / 30) for s in range(1, 81)]
    return dict(evaluator=EVALUATOR, classes=[], scored=scored, history=runs,
                decision=_decide("two_tower", EVALUATOR, scored))


def llm_sft() -> dict:
    """Arithmetic prompts: the challenger right on most, the champion on fewer; the untrained model's exact
    match as training logged it."""
    from pipeline.evaluate.language_model import EVALUATOR, exact_match

    prompts = [f"{a}+{b}=" for a, b in ((12, 34), (7, 8), (40, 2), (99, 1), (5, 5), (23, 19))]
    references = [str(eval(p[:-1])) for p in prompts]
    answers = {"challenger": ["46", "15", "42", "100", "1 0", "42"], "champion": ["46", "16", "41", "10", "10", "4 2 1"]}
    scored = {}
    for role, version in (("challenger", "3"), ("champion", "2")):
        loss = 0.4 if role == "challenger" else 0.9
        scored[role] = {"version": version, "metrics": {
            "exact_match": exact_match(answers[role], references), "loss": loss, "perplexity": float(np.exp(loss)),
            "rows": 6.0, "generated_rows": 6.0}, "details": {"samples": [
                {"prompt": p, "reference": r, "generated": g} for p, r, g in zip(prompts, references, answers[role])]}}
    steps = list(range(5, 61, 5))
    runs = {role: history(steps, loss_start=3.0, accuracy=False, seed=n) for n, role in enumerate(scored)}
    return dict(evaluator=EVALUATOR, classes=[], scored=scored, history=runs, logged={"baseline_test_exact_match": 0.0},
                decision=_decide("llm_sft", EVALUATOR, scored))


# Every recipe's case (the test of the registry checks that none is missing), and the extra shapes.
CASES: dict[str, Callable[[], dict]] = {
    "tabular_mlp": tabular_mlp, "image_classifier": image_classifier, "two_tower": two_tower, "llm_sft": llm_sft,
    "tabular_mlp_binary": tabular_mlp_binary,
}


def report(case: str) -> Report:
    return build_report(model_name=case, facts=(f"synthetic evaluation results ({case})",), **CASES[case]())
