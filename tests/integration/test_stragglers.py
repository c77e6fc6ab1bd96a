"""Every rank's figures and the stragglers among them (``pipeline.job.telemetry``), on real ranks: one rank made
slow with busy CPU work in its forward passes (``tests.slow_rank``) is named, exactly that one; an even run names
none."""

from __future__ import annotations

import json

import pytest

from pipeline import stages
from pipeline.recipes import tabular_mlp
from pipeline.job.supervisor import run_figures
from pipeline.job_files import JobFiles
from tests.jobs import run_torchrun

pytestmark = pytest.mark.distributed

RANKS = 3


def _run(demo_parquet, tmp_path, env: dict[str, str], **train) -> tuple[dict, list[str]]:
    cfg = tabular_mlp.config("tiny").with_overrides({
        "data.input_path": str(demo_parquet), "train.epochs": 2, "train.batch_size": 32, "train.log_every_steps": 10,
        "model.hidden_sizes": [256, 256],  # a forward pass of about a millisecond: the even ranks' noise is small
        **{f"train.{key}": value for key, value in train.items()}})
    dataset = stages.prepare_data(cfg, stages.RunInfo("stragglers", "even" if not env else "slow"))
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    lines: list[str] = []
    run_torchrun(["-m", "tests.slow_rank", "--recipe", "tabular_mlp", "--config", str(tmp_path / "config.json"),
                           "--dataset", dataset.uri, "--out", str(out)],
                          job_dir=out, nproc_per_node=RANKS, env=env, emit=lines.append, price_per_node_hour=3600.0)
    return run_figures(JobFiles(out)), lines


def _telemetry(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / "telemetry.jsonl").read_text().splitlines()]


def test_the_slow_rank_is_named_and_no_other(demo_parquet, tmp_path):
    figures, lines = _run(demo_parquet, tmp_path, {"SLOW_RANK": "2", "SLOW_RANK_MS": "15"})
    assert set(figures["stragglers"]) == {2}, figures["stragglers"]
    assert figures["stragglers"][2] > 1.3
    named = [line for line in lines if "straggler: rank" in line]
    assert named and all("straggler: rank 2 " in line for line in named), named
    assert "stragglers: rank 2 (" in next(line for line in lines if "per-rank figures over the run" in line)
    # Every rank's figures, every window, as MLflow metrics (the run's summary: ``run_figures``); the slow rank's compute time is its own.
    rows = _telemetry(tmp_path)
    windows = [row for row in rows if "rank_0/step_time_s" in row["metrics"]]
    assert len(windows) >= 5
    # The node's utilisation, sampled by its local rank 0 alone.
    assert any("node_0/cpu_percent" in row["metrics"] for row in rows)
    assert not any(key.startswith("node_1/") for row in rows for key in row["metrics"])
    assert set(figures["nodes"]) == {0}
    for window in windows:
        assert {f"rank_{r}/{k}" for r in range(RANKS) for k in ("step_time_s", "compute_s", "samples_per_s",
                                                              "data_wait_fraction", "straggler_score")} <= set(window["metrics"])
    ranks = figures["ranks"]
    assert ranks[2]["compute_s"] > 0.015 > max(ranks[0]["compute_s"], ranks[1]["compute_s"])
    # Step times cannot tell who is slow: the even ranks wait for it in the all-reduce.
    assert ranks[0]["step_time_s"] > 0.015 and ranks[1]["step_time_s"] > 0.015


def test_an_even_run_names_no_rank(demo_parquet, tmp_path):
    # Windows of 40 steps (about 40 ms of forward passes each, not 10): the suite's other lane shares the 2 cores
    # with these 3 ranks, and one of its bursts took a rank's 10-step windows to 1.6x for 3 windows in a row.
    figures, lines = _run(demo_parquet, tmp_path, {}, epochs=4, log_every_steps=40)
    assert figures["stragglers"] == {}
    assert not [line for line in lines if "straggler: rank" in line]
    assert set(figures["ranks"]) == set(range(RANKS))
    assert "stragglers: none" in next(line for line in lines if "per-rank figures over the run" in line)
    # One attempt on one CPU node, priced at 1 per node-second: its cost is the seconds it held the node.
    spent = figures["cost"]
    assert spent["attempts"] == 1 and spent["gpu_hours"] == 0
    assert spent["cost"] == pytest.approx(spent["wall_s"], rel=1e-3) and spent["wall_s"] > 0
    assert any(line.startswith(f"training cost {spent['cost']:.4g} ") for line in lines)
