"""Preemption on real ranks (2, gloo): SIGTERM mid-epoch, every rank stops at one agreed step, the step is
checkpointed, the ranks exit with ``PREEMPTED_EXIT_CODE`` beside the marker, and the restarted attempt
resumes from exactly that step to the parameters of an uninterrupted run.

The signal goes to each rank's process group, as the torchrun agent forwards it: the ranks' data loader
workers get it too, and must not die before their rank reaches the step boundary.
"""

from __future__ import annotations

import json
import os
import re
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pipeline import stages
from pipeline.job_files import PREEMPTED_EXIT_CODE, read_heartbeats
from pipeline.recipes import tabular_mlp
from tests.jobs import run_torchrun

pytestmark = pytest.mark.distributed

FAR_APART = 100_000  # periodic checkpoints never come: only the preemption's and the epochs' exist
MIN_STEP = 5


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def job(demo_parquet, tmp_path_factory, request):
    """About 150 steps per epoch on each of 2 ranks (several seconds here), a loader worker per rank; the model
    replicated (ddp) or sharded (fsdp: every rank writes its shards of the preemption's checkpoint)."""
    cfg = tabular_mlp.config("tiny").with_overrides({
        "data.input_path": str(demo_parquet), "train.epochs": 2, "train.batch_size": 16,
        "train.checkpoint_every_steps": FAR_APART, "train.log_every_steps": 25, "train.num_workers": 1,
        "train.lr_schedule": "cosine", "train.warmup_steps": 5, "train.parallelism": request.param,
    })
    dataset = stages.prepare_data(cfg, stages.RunInfo("preemption", "prep"))
    config_path = tmp_path_factory.mktemp("preemption") / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict()))
    return dataset, config_path


def _train(job, out: Path, lines: list[str], **options) -> dict:
    dataset, config_path = job
    run_torchrun(["-m", "pipeline.rank", "--recipe", "tabular_mlp", "--config", str(config_path),
                  "--dataset", dataset.uri, "--out", str(out)],
                 job_dir=out, nproc_per_node=2, emit=lines.append, grace_period_s=10, **options)
    return json.loads((out / "result.json").read_text())


def preempt_when_training(progress: Path, seen: dict, lines: list[str], min_step: int = MIN_STEP) -> threading.Thread:
    """Once the ranks train at a step >= ``min_step`` (both ranks' heartbeats say so, or rank 0's progress line
    does: a heartbeat comes at most once a second, a line at once): SIGTERM each rank's process group, rank 1
    first and rank 0 a moment later (the signal reaches ranks at different moments). The step signalled
    after goes into ``seen``."""

    def training_step(beats: dict) -> int:
        steps = [min(b["step"] for b in beats.values()) if all(b["phase"] == "training" for b in beats.values()) else 0]
        for line in reversed(lines[-20:]):
            found = re.search(r"\[default0\]:.*\bstep (\d+)/", line)
            if found:
                steps.append(int(found.group(1)))
                break
        return max(steps)

    def watch():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            beats = read_heartbeats(progress)
            step = training_step(beats) if sorted(beats) == [0, 1] else 0
            if step >= min_step:
                seen["signalled_after_step"] = step
                for rank in (1, 0):
                    os.killpg(beats[rank]["pid"], signal.SIGTERM)
                    time.sleep(0.2)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def preempted_step(lines: list[str], seen: dict) -> int:
    """The step every rank stopped at: rank 0 announced it once the marker was written, and the launcher,
    having read the marker, restarted the attempt on it."""
    output = "\n".join(lines)
    tail = "\n".join(lines[-60:])
    assert "signalled_after_step" in seen, f"the ranks were never signalled; last output lines:\n{tail}"
    announced = re.findall(r"\[default0\]:preempted: every rank stops at step (\d+), its checkpoint saved", output)
    restarted = re.findall(r"checkpointed at step (\d+); .*restarting every rank", output)
    assert announced and restarted == announced[:1], (
        f"signalled after step {seen['signalled_after_step']}: rank 0 announced {announced}, the launcher "
        f"restarted on {restarted}; last output lines:\n{tail}")
    return int(announced[0])


def rank_exit_codes(lines: list[str]) -> list[int]:
    """The exit codes torchrun's failure summary gives for its ranks (``exitcode  : 75 (pid: ...)``)."""
    return [int(code) for line in lines for code in re.findall(r"exitcode\s*:\s*(-?\d+)", line)]


@pytest.fixture(scope="module")
def reference(job, tmp_path_factory):
    """An uninterrupted run of the same config."""
    return _train(job, tmp_path_factory.mktemp("reference") / "out", [])


def test_sigterm_mid_epoch_checkpoints_the_agreed_step_and_the_restart_resumes_from_it(job, reference, tmp_path):
    out = tmp_path / "out"
    seen: dict = {}
    lines: list[str] = []
    watcher = preempt_when_training(out / "progress", seen, lines)
    result = _train(job, out, lines, max_restarts=1)
    watcher.join(timeout=5)
    steps_per_epoch = reference["steps"] // 2
    stopped = preempted_step(lines, seen)
    print(f"SIGTERM after step {seen['signalled_after_step']}; every rank stopped at step {stopped} "
          f"of {reference['steps']} ({steps_per_epoch} per epoch)")

    # The first attempt: both ranks stopped at one step after the signal, mid-epoch, and exited with the code.
    assert seen["signalled_after_step"] <= stopped < steps_per_epoch
    codes = rank_exit_codes(lines)
    assert codes and set(codes) == {PREEMPTED_EXIT_CODE}, f"rank exit codes {codes}"
    assert f"checkpoint step {stopped} (epoch 0)" in "\n".join(lines)  # the preemption's own checkpoint

    # The restart resumed from that step, not from an earlier checkpoint, and ended where an uninterrupted run does.
    assert result["start_step"] == stopped
    assert result["resumed_from"].endswith(f"step-{stopped:09d}")
    assert any(f"resumed from step {stopped} (epoch 1)" in line for line in lines)
    assert result["steps"] == reference["steps"]
    assert result["param_digests"] == reference["param_digests"], "the resumed run ended with other parameters"
    assert result["metrics"] == pytest.approx(reference["metrics"])


HF_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path

    import torch
    from torch.distributed.elastic.multiprocessing.errors import record
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from pipeline.config import PipelineConfig
    from pipeline.train.callbacks import huggingface_callback, last_huggingface_checkpoint
    from pipeline.train.context import RunContext
    from pipeline.train.distributed import DistContext


    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x, y):
            prediction = self.linear(x).squeeze(-1)
            return {"loss": torch.nn.functional.mse_loss(prediction, y), "logits": prediction}


    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randn(512, 4, generator=torch.Generator().manual_seed(0))
            self.y = self.x @ torch.tensor([1.0, -2.0, 3.0, 0.5])

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "y": self.y[i]}


    class Pace(TrainerCallback):
        # Long enough steps for a signal to land mid-run.
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(0.1)


    @record
    def main():
        out, max_steps = Path(sys.argv[1]), int(sys.argv[2])
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        ctx = RunContext(PipelineConfig(), DistContext(rank, int(os.environ["LOCAL_RANK"]), world,
                                                       torch.device("cpu"), "gloo"), out)
        args = TrainingArguments(output_dir=str(ctx.checkpoint_dir), max_steps=max_steps, per_device_train_batch_size=8,
                                 learning_rate=0.05, save_steps=1000, logging_steps=5, report_to=[],
                                 seed=0, disable_tqdm=True, use_cpu=True)
        trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(),
                          callbacks=[Pace(), huggingface_callback(ctx)])
        resume = last_huggingface_checkpoint(ctx)
        trainer.train(resume_from_checkpoint=resume)
        ctx.finish({"global_step": trainer.state.global_step, "resumed_from": resume})


    if __name__ == "__main__":
        main()
    """
)


def test_a_huggingface_trainer_stops_at_an_agreed_step_on_sigterm_and_resumes_there(tmp_path):
    """The callback's stop: the Trainer's own checkpoint of the agreed step, the marker, the exit code, and
    a restart that resumes from that checkpoint. (The Trainer's resume is not bit-exact here even from a
    periodic checkpoint, so the final parameters are not compared; the generic loop's test does that.)"""
    (tmp_path / "hf_preempt.py").write_text(HF_SCRIPT)
    max_steps = 60
    out = tmp_path / "job"
    seen: dict = {}
    lines: list[str] = []
    watcher = preempt_when_training(out / "progress", seen, lines, min_step=3)
    result = run_torchrun(["-m", "hf_preempt", str(out), str(max_steps)], job_dir=out, nproc_per_node=2,
                          env={"PYTHONPATH": str(tmp_path)}, emit=lines.append, grace_period_s=10, max_restarts=1)
    watcher.join(timeout=5)
    stopped = preempted_step(lines, seen)
    print(f"SIGTERM after step {seen['signalled_after_step']}; stopped at step {stopped} of {max_steps}")
    assert seen["signalled_after_step"] <= stopped < max_steps
    assert set(rank_exit_codes(lines)) == {PREEMPTED_EXIT_CODE}
    # The Trainer's checkpoint of the agreed step (save_steps is far off) is what the restart resumed from.
    checkpoint = out / "checkpoints" / f"checkpoint-{stopped}"
    assert result["resumed_from"] == str(checkpoint)
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == stopped
    assert result["global_step"] == max_steps


def test_a_lightning_trainer_stops_at_an_agreed_step_on_sigterm_and_resumes_there(tmp_path):
    """The two-tower recipe's Lightning fit: the callback takes SIGTERM back from Lightning's own handler,
    checkpoints the agreed step through the run context's store, and the restart resumes from it."""
    from pipeline.recipes import get_recipe
    from pipeline.recipes.two_tower.synthetic import write_interactions

    data = write_interactions(tmp_path / "interactions.parquet", users=200, items=80, clusters=4, per_user=15)
    cfg = get_recipe("two_tower").config("tiny").with_overrides({
        "data.input_path": str(data), "train.epochs": 2, "train.batch_size": 16, "train.num_workers": 1,
        "train.checkpoint_every_steps": FAR_APART, "train.log_every_steps": 1,
    })
    dataset = stages.prepare_data(cfg, stages.RunInfo("preemption-lightning", "prep"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    out = tmp_path / "out"
    seen: dict = {}
    lines: list[str] = []
    watcher = preempt_when_training(out / "progress", seen, lines, min_step=3)
    run_torchrun(["-m", "pipeline.rank", "--recipe", "two_tower", "--config", str(tmp_path / "config.json"),
                  "--dataset", dataset.uri, "--out", str(out)],
                 job_dir=out, nproc_per_node=2, emit=lines.append, grace_period_s=10, max_restarts=1)
    watcher.join(timeout=5)
    result = json.loads((out / "result.json").read_text())
    stopped = preempted_step(lines, seen)
    print(f"SIGTERM after step {seen['signalled_after_step']}; stopped at step {stopped} of {result['steps']}")
    assert seen["signalled_after_step"] <= stopped < result["steps"] // 2  # mid-epoch, in the first
    assert set(rank_exit_codes(lines)) == {PREEMPTED_EXIT_CODE}
    assert result["resumed_from_step"] == stopped
    assert any(f"resumed from step {stopped} (epoch 1)" in line for line in lines)
