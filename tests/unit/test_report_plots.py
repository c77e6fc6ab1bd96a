"""The report's plots as data, not pixels: the series, axes, limits and labels each plot was given, on the
synthetic evaluation results of every recipe (tests/reports.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.evaluate.classification_plots import confusion_plot, top_confusions
from pipeline.evaluate.report.plots import LABEL_CHARS
from tests import reports


def _table(report, caption: str):
    return next(item for section in report.sections for item in section.items
                if getattr(item, "caption", "").startswith(caption))


@pytest.fixture(scope="module")
def built():
    return {case: reports.report(case) for case in reports.CASES}


def test_losses_and_metrics_get_separate_axes_and_a_two_epoch_run_still_reads(built):
    plot = built["tabular_mlp"].plot("training_curves")
    loss, metrics = plot.panel("loss"), plot.panel("metrics")
    assert all(s.label.endswith("loss") for s in loss.series)
    assert all(s.label.endswith("accuracy") for s in metrics.series)
    assert loss.roles() == metrics.roles() == {"challenger", "champion"}
    # Two points per series, each marked, on an axis from step 0 to just past the last step (38).
    assert {s.x for s in loss.series + metrics.series} == {(19, 38)}
    assert all(s.marker for s in loss.series + metrics.series)
    assert loss.xlim[0] == 0 and 38 < loss.xlim[1] <= 40 and loss.integer_x
    # The accuracies on 0..1 of their own; the losses from 0 to above the highest (a validation loss over 5.5).
    assert metrics.ylim == (0.0, 1.02)
    highest = max(y for s in loss.series for y in s.y)
    assert highest > 5.5 and loss.ylim[0] == 0 and highest < loss.ylim[1] < highest * 1.2
    assert {s.style for s in loss.series if s.label.endswith("val_loss")} == {"dashed"}
    assert {s.style for s in loss.series if s.label.endswith("train_loss")} == {"solid"}


def test_long_runs_are_drawn_without_a_marker_per_point(built):
    plot = built["two_tower"].plot("training_curves")
    step_loss = [s for s in plot.panel("loss").series if s.label.endswith("step_loss")]
    assert len(step_loss) == 1 and len(step_loss[0].x) == 80 and not step_loss[0].marker
    assert step_loss[0].style == "dotted"
    assert [p.title for p in plot.panels] == ["loss"]  # no metric was logged: no empty panel


def test_ten_word_classes_are_labelled_slanted_counted_and_side_by_side(built):
    report = built["tabular_mlp"]
    plot = report.plot("confusion_matrix")
    assert [p.title for p in plot.panels] == ["challenger v3", "champion v2"] and plot.columns == 2
    names = ("eight", "five", "four", "nine", "zero", "one", "two", "three", "six", "seven")
    for panel in plot.panels:
        heatmap = panel.heatmap
        assert heatmap.labels == names and heatmap.rotation == 45 and heatmap.annotate
        counts = np.asarray(heatmap.counts)
        assert np.allclose(np.asarray(heatmap.shares), counts / counts.sum(axis=1, keepdims=True))
        assert counts.sum() == 600


def test_many_long_class_names_are_cut_and_stand_upright():
    names = [f"a rather long class name number {k}" for k in range(30)]
    matrix = np.diag(np.full(30, 5))
    matrix[0, 1] = 3
    heatmap = confusion_plot(names, {"challenger": matrix}, {"challenger": "challenger v1"}).panels[0].heatmap
    assert len(heatmap.labels) == 30 and all(len(label) <= LABEL_CHARS for label in heatmap.labels)
    assert heatmap.labels[0].endswith("…") and heatmap.rotation == 90 and not heatmap.annotate
    assert len(set(heatmap.labels)) < 30  # cut names collide: the tables carry them whole


def test_a_hundred_classes_list_their_top_confusions_by_name(built):
    report = built["image_classifier"]
    plot = report.plot("confusion_matrix")
    assert plot.columns == 1 and [len(p.heatmap.counts) for p in plot.panels] == [100, 100]
    assert all(p.heatmap.labels == () and not p.heatmap.annotate for p in plot.panels)
    section = next(s for s in report.sections if s.title == "Confusion matrices")
    table = _table(report, "Most frequent confusions")
    assert table in section.items
    assert 0 < len(table.rows) <= 15 and table.columns[:2] == ("true class", "predicted as")
    # Each row names both classes in full with their index, and gives each model's count of that mistake.
    counts = {role: np.asarray(p.heatmap.counts) for role, p in zip(("challenger", "champion"), plot.panels)}
    worst = []
    for true, predicted, ours, _, theirs, _ in table.rows:
        i, j = int(true.split(":")[0]), int(predicted.split(":")[0])
        assert true == f"{i}: {reports.ADJECTIVES[i // 10]} {reports.NOUNS[i % 10]}" and i != j
        assert (ours, theirs) == (counts["challenger"][i, j], counts["champion"][i, j])
        worst.append(max(ours, theirs))
    assert worst == sorted(worst, reverse=True)


def test_top_confusions_skip_the_diagonal_and_empty_cells():
    matrix = np.array([[9, 0, 2], [4, 7, 0], [0, 0, 5]])
    table = top_confusions(["a", "b", "c"], {"challenger": matrix}, {"challenger": "challenger v1"})
    assert [(row[0], row[1], row[2]) for row in table.rows] == [("b", "a", 4), ("a", "c", 2)]
    assert table.rows[0][3] == pytest.approx(4 / 11)


def test_per_class_f1_is_sorted_lowest_first_with_both_models(built):
    report = built["image_classifier"]
    plot = report.plot("per_class_f1")
    panel = plot.panels[0]
    challenger, champion = panel.series
    assert (challenger.role, champion.role) == ("challenger", "champion")
    assert list(challenger.y) == sorted(challenger.y) and len(challenger.y) == 40
    assert "the 40 lowest of 100 classes" in plot.title and panel.xlim == (0.0, 1.0)
    assert challenger.x == champion.x and len(panel.categories) == 40
    # The 40 shown are the lowest of all 100 (the per-class table, in the same order, has them all).
    table = _table(report, "Per class")
    assert [row[0] for row in table.rows][:40] == list(challenger.x)
    assert [row[4] for row in table.rows][:40] == list(challenger.y)
    assert [row[7] for row in table.rows][:40] == list(champion.y)
    assert max(challenger.y) <= min(row[4] for row in table.rows[40:])


def test_binary_curves_stand_against_chance(built):
    report = built["tabular_mlp_binary"]
    roc, pr = report.plot("roc_pr").panels
    assert [s.role for s in roc.series] == ["challenger", "baseline"]  # no champion yet
    assert roc.series[-1].x == (0.0, 1.0) and roc.series[-1].y == (0.0, 1.0)
    support = {row[0]: row[1] for row in _table(report, "Per class").rows}
    assert pr.series[-1].y == (support["yes"] / (support["yes"] + support["no"]),) * 2
    assert roc.xlim == pr.xlim == (0.0, 1.0)
    assert "AUC" in roc.series[0].label and "AP" in pr.series[0].label


def test_recall_and_ndcg_over_k_agree_with_the_key_figures(built):
    report = built["two_tower"]
    plot = report.plot("retrieval_at_k")
    figures = report.figures
    for title, metric in (("recall@k", "recall_at_10"), ("NDCG@k", "ndcg_at_10")):
        panel = plot.panel(title)
        assert [s.role for s in panel.series] == ["challenger", "champion", "baseline"]
        assert panel.xscale == "log" and panel.xticks == (1, 2, 5, 10, 20, 50)
        for s in panel.series:
            assert s.x == (1, 2, 5, 10, 20, 50)
            assert s.y[3] == pytest.approx(figures.value(s.role, metric))
            assert panel.ylim[0] == 0 and max(s.y) <= panel.ylim[1]
    recall = plot.panel("recall@k")
    assert all(s.y[-1] == pytest.approx(figures.value(s.role, "recall_at_50")) for s in recall.series)
    assert all(list(s.y) == sorted(s.y) for s in recall.series)  # recall never falls as k grows


def test_sample_generations_mark_each_models_mismatches(built):
    report = built["llm_sft"]
    samples = next(i for s in report.sections for i in s.items if type(i).__name__ == "Samples")
    assert list(samples.labels.values()) == ["challenger v3", "champion v2"]
    matches = {role: [row.matches(role) for row in samples.rows] for role in samples.labels}
    assert matches == {"challenger": [True, True, True, True, False, True],
                       "champion": [True, False, False, False, True, False]}
    # The same exact match as the key figures'.
    assert np.mean(matches["challenger"]) == pytest.approx(report.figures.value("challenger", "exact_match"))
    wrong = samples.rows[1]  # 7+8=15, the champion said 16
    assert wrong.diff("champion") == [("extra", "16"), ("missing", "15")]
    assert samples.rows[4].diff("challenger") == [("extra", "1 0"), ("missing", "10")]
    assert report.figures.value("baseline", "exact_match") == 0.0  # the untrained model, as training logged it
