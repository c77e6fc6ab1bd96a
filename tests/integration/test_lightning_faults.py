"""The two-tower recipe's Lightning trainer under the pipeline's torchrun launcher (2 ranks, gloo),
with a rank killed mid-epoch: the run context's checkpoints are where torchrun's restart resumes from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import stages
from pipeline.recipes import get_recipe
from tests.faults import sigkill_rank, when_checkpoint
from tests.jobs import run_torchrun

pytestmark = pytest.mark.distributed

CHECKPOINT_EVERY = 10


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from pipeline.recipes.two_tower.synthetic import write_interactions

    root = tmp_path_factory.mktemp("lightning")
    data = write_interactions(root / "interactions.parquet", users=200, items=80, clusters=4, per_user=15)
    cfg = get_recipe("two_tower").config("tiny").with_overrides({
        "data.input_path": str(data), "train.epochs": 2, "train.batch_size": 32,
        "train.checkpoint_every_steps": CHECKPOINT_EVERY, "train.log_every_steps": 1,
    })
    dataset = stages.prepare_data(cfg, stages.RunInfo("lightning-faults", "prep"))
    config_path = root / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict()))
    return dataset, config_path


def _train(job, out: Path, lines: list[str], **options) -> dict:
    dataset, config_path = job
    run_torchrun(["-m", "pipeline.rank", "--recipe", "two_tower", "--config", str(config_path),
                  "--dataset", dataset.uri, "--out", str(out)],
                 job_dir=out, nproc_per_node=2, emit=lines.append, grace_period_s=3, **options)
    return json.loads((out / "result.json").read_text())


def test_lightning_trains_under_torchrun_and_a_killed_rank_resumes_mid_epoch(job, tmp_path):
    reference_lines: list[str] = []
    reference = _train(job, tmp_path / "reference", reference_lines)
    assert reference["world_size"] == 2 and reference["resumed_from_step"] == 0
    steps_per_epoch = reference["steps"] // 2
    assert steps_per_epoch > CHECKPOINT_EVERY + 2, "the kill must land mid-epoch"
    # One progress line per step from rank 0, and the run's files for registration.
    assert any(f"step {reference['steps']}/{reference['steps']}" in line for line in reference_lines)
    assert set(reference["model_files"]) == {"network", "catalogue", "users"}

    out = tmp_path / "killed"
    killed: dict = {}
    lines: list[str] = []
    watcher = when_checkpoint(out, sigkill_rank(1, killed), CHECKPOINT_EVERY)
    result = _train(job, out, lines, max_restarts=1)
    watcher.join(timeout=5)
    assert killed, "the rank was never killed"
    print(f"rank 1 killed; resumed from step {result['resumed_from_step']} of {result['steps']} "
          f"({steps_per_epoch} per epoch)")
    assert any(f"resumed from step {result['resumed_from_step']}" in line for line in lines)
    assert CHECKPOINT_EVERY <= result["resumed_from_step"] < steps_per_epoch  # mid-epoch, from a checkpoint
    assert result["steps"] == reference["steps"]  # the restored loader skipped what was already trained on
    # Same data order, same optimizer state, no randomness in the step: the same model at the end.
    assert result["metrics"]["val_loss"] == pytest.approx(reference["metrics"]["val_loss"], rel=1e-4)


def test_a_frozen_lightning_rank_is_detected_by_the_stall_watchdog(job, tmp_path):
    """The Lightning callback's heartbeats are what the launcher's watchdog reads: a rank that stops
    making steps (SIGSTOP, like a deadlock) fails the attempt as a retryable stall."""
    import os
    import signal

    from pipeline.errors import TrainingFailed, TrainingStalled

    out = tmp_path / "frozen"
    frozen: dict = {}

    def freeze_rank_1(beats):
        frozen["pid"] = beats[1]["pid"]
        os.kill(beats[1]["pid"], signal.SIGSTOP)

    watcher = when_checkpoint(out, freeze_rank_1, CHECKPOINT_EVERY)
    with pytest.raises(TrainingStalled) as err:
        _train(job, out, [], stall_timeout_s=5)
    watcher.join(timeout=5)
    assert frozen, "the rank was never frozen"
    assert "training stalled: no step completed" in str(err.value) and "rank 1: step" in str(err.value)
    assert isinstance(err.value, TrainingFailed)
