"""``pipeline.job.cost``: each attempt's hours and cost, summed over a run's attempts and task tries."""

from __future__ import annotations

import pytest

from pipeline.job import cost
from pipeline.job.spec import launch_config


def test_attempts_are_priced_by_the_nodes_and_gpus_their_ranks_held_and_summed(tmp_path):
    path = tmp_path / "attempts.jsonl"
    launch = launch_config({"kind": "kubernetes", "nnodes": 2, "nproc_per_node": 4, "gpus_per_node": 4, "price_per_gpu_hour": 2.5,
                            "price_per_node_hour": 1.0})
    # Two nodes' ranks for half an hour, preempted; then an elastic restart on the one node left for an hour.
    first = cost.record(path, launch, started=1000.0, ended=2800.0, ranks=8, status="failed")
    second = cost.record(path, launch, started=2900.0, ended=6500.0, ranks=4, status="succeeded", restart=1)
    assert (first["nodes"], first["gpus"], first["gpu_hours"], first["node_hours"]) == (2, 8, 4.0, 1.0)
    assert first["cost"] == pytest.approx(4.0 * 2.5 + 1.0 * 1.0)
    assert (second["nodes"], second["gpu_hours"], second["cost"]) == (1, 4.0, pytest.approx(11.0))
    # An attempt whose ranks never reported held the nodes asked for.
    cost.record(path, launch, started=0.0, ended=360.0, ranks=0, status="not_started", try_number=2)
    run = cost.summarize(path)
    assert run == {"attempts": 3, "wall_s": 5760.0, "node_hours": 2.2, "gpu_hours": 8.8, "cost": pytest.approx(24.2)}
    assert cost.tags(run)["cost.gpu_hours"] == "8.8"
    assert cost.describe(run).startswith("training cost 24.2 for 8.8 GPU-hours and 2.2 node-hours over 3 attempt(s)")


def test_a_run_without_records_has_no_cost(tmp_path):
    assert cost.summarize(tmp_path / "attempts.jsonl") is None
    assert cost.describe(None) is None
