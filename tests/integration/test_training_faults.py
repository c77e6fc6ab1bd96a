"""Fault injection on real torchrun jobs (2 ranks, gloo): killed workers, damaged checkpoints, hung ranks."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from pipeline import stages
from pipeline.errors import TrainingFailed, TrainingStalled
from pipeline.recipes import tabular_mlp
from tests.faults import sigkill_rank, when_checkpoint
from tests.jobs import run_torchrun

pytestmark = pytest.mark.distributed

CHECKPOINT_EVERY = 10


@pytest.fixture(scope="module")
def job(demo_parquet, tmp_path_factory):
    """A tiny config (about 150 steps per epoch on each of 2 ranks) and its published dataset."""
    cfg = tabular_mlp.config("tiny").with_overrides({
        "data.input_path": str(demo_parquet), "train.epochs": 2, "train.batch_size": 16,
        "train.checkpoint_every_steps": CHECKPOINT_EVERY, "train.log_every_steps": 1,
        "train.lr_schedule": "cosine", "train.warmup_steps": 5,
    })
    dataset = stages.prepare_data(cfg, stages.RunInfo("faults", "prep"))
    config_path = tmp_path_factory.mktemp("faults") / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict()))
    return cfg, dataset, config_path


def _train(job, out: Path, lines: list[str] | None = None, **options) -> dict:
    cfg, dataset, config_path = job
    run_torchrun(
        ["-m", "pipeline.rank", "--recipe", "tabular_mlp", "--config", str(config_path), "--dataset", dataset.uri,
         "--out", str(out)],
        job_dir=out, nproc_per_node=2, emit=(lines.append if lines is not None else lambda line: None),
        grace_period_s=3, **options,
    )
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory):
    """An uninterrupted run: the parameters every resumed run must end with."""
    out = tmp_path_factory.mktemp("reference")
    return out, _train(job, out)


def _when_checkpoint(out: Path, action, min_step: int = CHECKPOINT_EVERY):
    return when_checkpoint(out, action, min_step)


def test_a_worker_killed_mid_epoch_is_restarted_and_resumes_to_identical_parameters(job, reference, tmp_path):
    _, expected = reference
    out = tmp_path / "out"
    killed: dict = {}
    lines: list[str] = []
    watcher = _when_checkpoint(out, sigkill_rank(1, killed))
    result = _train(job, out, lines, max_restarts=1)
    watcher.join(timeout=5)
    assert killed, "the worker was never killed"
    resumed_at = next(i for i, line in enumerate(lines) if "resuming from checkpoint" in line)
    steps_before = [int(line.split(" step ")[1].split("/")[0]) for line in lines[:resumed_at]
                    if " step " in line and "loss" in line]
    last_step_before_kill = max(steps_before)
    steps_per_epoch = expected["steps"] // 2
    print(f"rank 1 killed after step {last_step_before_kill}; resumed at step {result['start_step']} "
          f"of {result['steps']} ({steps_per_epoch} per epoch)")
    assert 0 < result["start_step"] < result["steps"]
    assert last_step_before_kill - result["start_step"] <= CHECKPOINT_EVERY  # at most one interval redone
    assert result["param_digests"] == expected["param_digests"], "resumed run ended with other parameters"
    assert result["metrics"] == pytest.approx(expected["metrics"])


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(job, reference, tmp_path):
    ref_out, expected = reference
    import shutil

    out = tmp_path / "out"
    shutil.copytree(ref_out / "checkpoints", out / "checkpoints")
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    newest, previous = checkpoints[-1], checkpoints[-2]
    (newest / "state.pt").write_bytes((newest / "state.pt").read_bytes()[:1000])  # a write cut short
    lines: list[str] = []
    result = _train(job, out, lines)
    assert any(f"checkpoint {newest} is damaged" in line for line in lines)
    assert result["resumed_from"] == str(previous)
    assert result["start_step"] == int(previous.name.split("-")[1])
    assert result["param_digests"] == expected["param_digests"]


def test_a_hung_rank_is_detected_as_a_stall(job, tmp_path):
    out = tmp_path / "out"
    stopped = {}

    def freeze_rank_1(beats):
        stopped["at"] = time.monotonic()
        os.kill(beats[1]["pid"], signal.SIGSTOP)  # alive but making no progress, like a deadlocked rank

    watcher = _when_checkpoint(out, freeze_rank_1)
    # Set-up (imports, DDP's first compile) makes no step either: the timeout must outlast it on a loaded machine.
    stall_timeout_s = 15
    with pytest.raises(TrainingStalled) as err:
        _train(job, out, stall_timeout_s=stall_timeout_s)
    detected_after = time.monotonic() - stopped["at"]
    watcher.join(timeout=5)
    print(f"stall detected {detected_after:.1f}s after rank 1 froze: {str(err.value).splitlines()[0]}")
    message = str(err.value)
    # The watchdog, not the job's own timeout, stopped it, and it says how long nothing moved.
    assert f"launch.stall_timeout_s={stall_timeout_s}" in message
    assert "training stalled: no step completed" in message and "rank 1: step" in message
    assert isinstance(err.value, TrainingFailed)  # an infrastructure fault: the task is retried
