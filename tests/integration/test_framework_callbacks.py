"""A framework trainer that brings its own loop (Hugging Face ``Trainer``) reaches the pipeline's run context
through callbacks: 2 real ranks under the launcher, heartbeats, metrics in MLflow, checkpoints where a
second attempt resumes from."""

import json
import textwrap

import pytest

from pipeline.job_files import read_heartbeats
from tests.jobs import run_torchrun

pytestmark = pytest.mark.distributed

SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path

    import torch
    from torch.distributed.elastic.multiprocessing.errors import record
    from transformers import Trainer, TrainingArguments

    from pipeline.config import PipelineConfig
    from pipeline.job_files import user_errors_reported
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
            self.x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
            self.y = self.x @ torch.tensor([1.0, -2.0, 3.0, 0.5])

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "y": self.y[i]}


    @record
    def main():
        out, max_steps, use_cpu = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] != ["--without-use-cpu"]
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        ctx = RunContext(PipelineConfig(), DistContext(rank, int(os.environ["LOCAL_RANK"]), world,
                                                       torch.device("cpu"), "gloo"), out)
        args = TrainingArguments(output_dir=str(ctx.checkpoint_dir), max_steps=max_steps, per_device_train_batch_size=8,
                                 learning_rate=0.05, save_steps=5, logging_steps=2, report_to=[],
                                 seed=0, disable_tqdm=True, use_cpu=use_cpu)
        with user_errors_reported():
            trainer = Trainer(model=Regression(), args=args, train_dataset=Rows(),
                              callbacks=[huggingface_callback(ctx)])
        resume = last_huggingface_checkpoint(ctx)
        trainer.train(resume_from_checkpoint=resume)
        ctx.finish({"global_step": trainer.state.global_step, "resumed_from": resume, "world_size": world,
                    "trainer_world_size": trainer.args.world_size})


    if __name__ == "__main__":
        main()
    """
)


def test_a_huggingface_trainer_gets_heartbeats_metrics_and_resumable_checkpoints(tmp_path):
    from pipeline.registry import tracking

    (tmp_path / "hf_job.py").write_text(SCRIPT)
    run_id = tracking.ensure_run("hf_callbacks", f"hf/{tmp_path.name}", {})
    out = tmp_path / "job"
    env = {"PYTHONPATH": str(tmp_path), "MLFLOW_RUN_ID": run_id}

    first = run_torchrun(["-m", "hf_job", str(out), "10"], job_dir=out, nproc_per_node=2, env=env,
                         emit=lambda line: None, grace_period_s=3)
    # The Trainer ran as one job of 2 processes (not 2 single-process runs), so each rank kept its own RNG state.
    assert first == {**first, "global_step": 10, "resumed_from": None, "world_size": 2, "trainer_world_size": 2}
    beats = read_heartbeats(out / "progress")
    assert sorted(beats) == [0, 1] and all(beat["step"] == 10 and beat["total"] == 10 for beat in beats.values())
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-10", "checkpoint-5"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (out / "checkpoints" / "checkpoint-10").iterdir()}
    losses = tracking.client().get_metric_history(run_id, "loss")
    assert [m.step for m in losses] == [2, 4, 6, 8, 10]

    # A second attempt (a restart or an Airflow retry) with more steps resumes from the newest checkpoint.
    second = run_torchrun(["-m", "hf_job", str(out), "14"], job_dir=out, nproc_per_node=2, env=env,
                          emit=lambda line: None, grace_period_s=3)
    assert second["global_step"] == 14 and second["resumed_from"].endswith("checkpoint-10")
    assert json.loads((out / "result.json").read_text())["global_step"] == 14


def test_a_huggingface_trainer_that_would_train_each_rank_alone_is_refused(tmp_path):
    """On a CPU without ``use_cpu=True`` the Trainer joins no process group: each rank would train its own model
    and write the same checkpoint files. The callback fails the job at once with what to pass, as a user error
    (no restart, no retry), before any checkpoint is written."""
    from pipeline.errors import RankUserError

    (tmp_path / "hf_job.py").write_text(SCRIPT)
    out = tmp_path / "job"
    with pytest.raises(RankUserError, match=r"sees 1 process\(es\) of the job's 2.*TrainingArguments\(use_cpu=True\)"):
        run_torchrun(["-m", "hf_job", str(out), "10", "--without-use-cpu"], job_dir=out, nproc_per_node=2,
                     env={"PYTHONPATH": str(tmp_path)}, emit=lambda line: None, grace_period_s=3, max_restarts=1)
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
