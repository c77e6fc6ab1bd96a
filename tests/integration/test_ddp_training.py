"""A real 2-rank gloo DDP run of the training entrypoint under torchrun."""

import json
import math
from pathlib import Path

import pytest

from pipeline import stages
from pipeline.recipes import tabular_mlp
from tests.jobs import run_torchrun

pytestmark = pytest.mark.distributed


def test_two_ranks_train_in_lockstep(demo_parquet, tmp_path, monkeypatch):
    # Published under a folder with a space and a '%': the ranks get it as a percent-encoded file URI.
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(tmp_path / "data dir 100%"))
    tmp_path = tmp_path / "job dir"
    cfg = tabular_mlp.config("tiny").with_overrides({"data.input_path": str(demo_parquet), "train.epochs": 2})
    dataset = stages.prepare_data(cfg, stages.RunInfo("test", "ddp"))
    assert "%20" in dataset.uri and "%25" in dataset.uri
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    lines = []
    run_torchrun(
        ["-m", "pipeline.rank", "--recipe", "tabular_mlp", "--config", str(tmp_path / "config.json"),
         "--dataset", dataset.uri, "--out", str(tmp_path / "out")],
        job_dir=tmp_path / "out", nproc_per_node=2, emit=lines.append,
    )
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    digests = result["param_digests"]
    assert len(digests) == 2 and digests[0] == digests[1], f"ranks diverged: {digests}"
    # Each rank streamed half of the training split per epoch.
    per_rank = math.ceil(dataset.rows["train"] / 2)
    assert result["steps"] == math.ceil(per_rank / cfg.train.batch_size) * cfg.train.epochs
    assert result["metrics"]["train_loss"] < math.log(3)  # learned something beyond uniform guessing
    assert Path(result["model_files"]["network"]).exists()
    assert any("samples/s" in line for line in lines)
    # Rank 0's timeline: every phase, in the order reached, and its start-up logged at the first step.
    timeline = result["timeline"]
    assert list(timeline) == ["process_start", "imports_done", "process_group_ready", "run_context_ready",
                              "data_opened", "model_and_data_ready", "first_step", "last_step", "model_saved"]
    assert list(timeline.values()) == sorted(timeline.values())
    startup = next(line for line in lines if "start-up " in line)
    assert "[default0]:" in startup and "first step" in startup


def test_state_digest_tells_different_parameters_apart():
    import torch

    from pipeline.train.distributed import state_digest

    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert state_digest(a) == state_digest(b)
    with torch.no_grad():
        b.bias[0] += 1e-6
    assert state_digest(a) != state_digest(b)
